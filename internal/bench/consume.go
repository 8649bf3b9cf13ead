package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/bench/consumerbench"
	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/schema"
)

func init() { registerBench("consume", benchConsume) }

// localDatabaseURL is the machine's trust-auth PostgreSQL, used when neither
// --database-url nor KM0_DATABASE_URL is given.
const localDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// benchConsume is `km0 bench consume`: one JSON line per run and, with
// --poison-rate, the 0% case too (alternating, --runs times each) and a
// summary line with the medians and their ratio.
func benchConsume(ctx context.Context, args []string) error {
	fs := cli.NewFlags("bench consume", "consume N events idempotently from an embedded broker into PostgreSQL; one JSON line per result")
	n := fs.Int("n", consumerbench.NDefault, "events to produce and consume per run")
	poison := fs.Float64("poison-rate", 0, "fraction of malformed-JSON events in [0, 1); above 0 the 0% case runs too, for the ratio")
	runs := fs.Int("runs", 1, "runs of each case (the summary uses the medians)")
	batch := fs.Int("batch", consumer.BatchSizeDefault, "events per transaction (each with its own key)")
	conc := fs.Int("concurrency", consumerbench.ConcurrencyDefault, "transactions at once (= PostgreSQL connections)")
	keys := fs.Int("keys", consumerbench.KeysDefault, "distinct agregat_id keys")
	handler := fs.String("handler", "message", "message: one statement per event (Handle); batch: one per transaction (HandleBatch)")
	validate := fs.Bool("validate", false, "also run every case with a validating schema.Decoder (JSON Schema of comanda.creada) and print the ratio")
	order := fs.String("order", "unordered", "unordered, or per-key: also run every case with consumer.PerKey and print the per-key/unordered ratio")
	dbURL := cli.DatabaseURLFlag(fs)
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *order != "unordered" && *order != "per-key" {
		return fmt.Errorf("--order %q: want unordered or per-key", *order)
	}
	orders := []bool{false}
	if *order == "per-key" {
		orders = []bool{false, true}
	}
	byOrder := map[bool][]float64{}
	if *handler != "message" && *handler != "batch" {
		return fmt.Errorf("--handler %q: want message or batch", *handler)
	}
	if *n < 1 || *runs < 1 || *poison < 0 || *poison >= 1 || math.IsNaN(*poison) || *batch < 1 || *conc < 1 || *keys < 1 {
		return errors.New("need --n, --runs, --batch, --concurrency, --keys >= 1 and 0 <= --poison-rate < 1")
	}
	url := *dbURL
	if url == "" {
		url = localDatabaseURL
	}
	cfg := consumerbench.Config{DatabaseURL: url, N: *n, BatchSize: *batch, Concurrency: *conc, Keys: *keys, Batch: *handler == "batch"}
	rates := []float64{*poison}
	if *poison > 0 {
		rates = []float64{0, *poison}
	}
	validations := []bool{false}
	var dec *schema.Decoder
	if *validate {
		validations = []bool{false, true}
		var err error
		if dec, err = schema.NewDecoder(schema.DecoderConfig{Handles: map[string]int{"comanda.creada": 1}}); err != nil {
			return err
		}
	}
	enc := json.NewEncoder(os.Stdout)
	healthy := map[float64][]float64{}
	validated := map[bool][]float64{}
	for range *runs {
		for _, rate := range rates {
			for _, v := range validations {
				for _, pk := range orders {
					cfg.PoisonRate, cfg.Validated, cfg.Decode, cfg.PerKey = rate, v, nil, pk
					if v {
						cfg.Decode = dec.Decode
					}
					res, err := consumerbench.Run(ctx, cfg)
					if err != nil {
						return err
					}
					if !v && !pk {
						healthy[rate] = append(healthy[rate], res.HealthyPerS)
					}
					if rate == *poison && !pk {
						validated[v] = append(validated[v], res.HealthyPerS)
					}
					if rate == *poison && !v {
						byOrder[pk] = append(byOrder[pk], res.HealthyPerS)
					}
					if err := enc.Encode(res); err != nil {
						return err
					}
				}
			}
		}
	}
	if *order == "per-key" {
		off, on := median(byOrder[false]), median(byOrder[true])
		ratio := math.Round(on/off*1000) / 1000
		if err := enc.Encode(map[string]any{
			"bench": "consume_order", "poison_rate": *poison, "runs": *runs, "handler": *handler,
			"per_key_healthy_per_s": on, "unordered_healthy_per_s": off, "ratio": ratio, "target_met": ratio >= 0.90,
		}); err != nil {
			return err
		}
	}
	if *validate {
		off, on := median(validated[false]), median(validated[true])
		ratio := math.Round(on/off*1000) / 1000
		if err := enc.Encode(map[string]any{
			"bench": "consume_validation", "poison_rate": *poison, "runs": *runs, "handler": *handler,
			"events_per_s": on, "validated_healthy_per_s": on, "unvalidated_healthy_per_s": off,
			"ratio": ratio, "target_met": ratio >= 0.90,
		}); err != nil {
			return err
		}
	}
	if *poison == 0 {
		return nil
	}
	base, with := median(healthy[0]), median(healthy[*poison])
	ratio := math.Round(with/base*1000) / 1000
	return enc.Encode(map[string]any{
		"bench": "consume_poison", "poison_rate": *poison, "runs": *runs, "handler": *handler,
		"events_per_s": with, "healthy_per_s": with, "baseline_healthy_per_s": base,
		"healthy_ratio": ratio, "target_met": ratio >= 0.90,
	})
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
