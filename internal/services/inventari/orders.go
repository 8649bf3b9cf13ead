package inventari

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// States of comandes_estoc.estat.
const (
	statePending   = "pendent"
	stateServed    = "servida"
	stateRefused   = "refusada"
	stateCancelled = "cancellada"
)

// StockRefused is the dades of estoc.refusat (schemas/estoc.refusat/v1.json).
type StockRefused struct {
	OrderID string `json:"comanda_id"`
	Reason  string `json:"motiu"` // estoc_insuficient or producte_desconegut
	Detail  string `json:"detall,omitempty"`
}

// orderRecord is an order's row of comandes_estoc, locked for the batch.
type orderRecord struct {
	id       string
	state    string
	lines    []Line // taken (servida)
	restored bool
	reason   string // of the refusal: "estoc_insuficient: …"
	dirty    bool
}

// orderLockClass is the first key of the transaction-scoped advisory lock
// of an order (the second is hashtext(comanda_id)); the two-key space does
// not overlap the outbox trigger's one-key locks.
const orderLockClass = 0x696e76 // "inv"

// SQL of the orders' rows. lockOrdersSQL takes every order's advisory lock
// in comanda_id order, whether or not its row exists yet (a cancellation
// may be writing its tombstone); readOrdersSQL then reads the rows and
// writeOrdersSQL writes the changed ones in one upsert: one row write per
// order.
const (
	lockOrdersSQL  = `SELECT count(pg_advisory_xact_lock($2::int, hashtext(id))) FROM (SELECT id FROM unnest($1::text[]) AS id ORDER BY id) o`
	readOrdersSQL  = `SELECT comanda_id, estat, linies, restaurada, coalesce(motiu, '') FROM comandes_estoc WHERE comanda_id = ANY($1::text[])`
	writeOrdersSQL = `INSERT INTO comandes_estoc AS c (comanda_id, estat, linies, restaurada, motiu)
		SELECT v.comanda_id, v.estat, v.linies::jsonb, v.restaurada, nullif(v.motiu, '')
		FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[], $5::text[]) AS v(comanda_id, estat, linies, restaurada, motiu)
		ON CONFLICT (comanda_id) DO UPDATE SET estat = EXCLUDED.estat, linies = EXCLUDED.linies, restaurada = EXCLUDED.restaurada,
		motiu = EXCLUDED.motiu, actualitzat_en = now()`
)

func lockOrders(ctx context.Context, tx pgx.Tx, ids []string) (map[string]*orderRecord, error) {
	recs := make(map[string]*orderRecord, len(ids))
	if len(ids) == 0 {
		return recs, nil
	}
	ids = slices.Clone(ids)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	var n int
	if err := tx.QueryRow(ctx, lockOrdersSQL, ids, orderLockClass).Scan(&n); err != nil {
		return nil, fmt.Errorf("inventari: lock orders: %w", err)
	}
	for _, id := range ids {
		recs[id] = &orderRecord{id: id, state: statePending}
	}
	rows, err := tx.Query(ctx, readOrdersSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("inventari: read comandes_estoc: %w", err)
	}
	var (
		r     orderRecord
		lines []byte
	)
	_, err = pgx.ForEachRow(rows, []any{&r.id, &r.state, &lines, &r.restored, &r.reason}, func() error {
		rec := r
		if err := json.Unmarshal(lines, &rec.lines); err != nil {
			return fmt.Errorf("linies of %s: %w", rec.id, err)
		}
		if rec.state == stateCancelled && rec.restored {
			rec.lines = nil // given back already: nothing for a cancellation to restore again
		}
		recs[rec.id] = &rec
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("inventari: read comandes_estoc: %w", err)
	}
	return recs, nil
}

func writeOrders(ctx context.Context, tx pgx.Tx, recs map[string]*orderRecord) error {
	var ids, states, lines, reasons []string
	var restored []bool
	for _, r := range recs {
		if !r.dirty {
			continue
		}
		b, _ := json.Marshal(r.lines)
		if r.lines == nil {
			b = []byte("[]")
		}
		ids, states, lines, restored, reasons = append(ids, r.id), append(states, r.state), append(lines, string(b)), append(restored, r.restored), append(reasons, r.reason)
	}
	if len(ids) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, writeOrdersSQL, ids, states, lines, restored, reasons); err != nil {
		return fmt.Errorf("inventari: write comandes_estoc: %w", err)
	}
	return nil
}

type orderCancelled struct {
	OrderID string `json:"comanda_id"`
}

func decodeCancel(m *consumer.Message) (order, error) {
	var c orderCancelled
	if err := strictjson.Unmarshal(m.Envelope.Data, &c); err != nil {
		return order{}, outcome.Permanentf("esquema: comanda.cancellada: %v", err)
	}
	if c.OrderID == "" {
		return order{}, outcome.Permanentf("esquema: comanda.cancellada without comanda_id")
	}
	if err := requestreply.CheckID("esquema: comanda.cancellada: comanda_id", c.OrderID, 0); err != nil {
		return order{}, err
	}
	return order{id: c.OrderID, cancel: true}, nil
}

// refusedAgain is the outcome of an order refused before (replayed from the
// DLQ): the same refusal, without a second estoc.refusat.
func refusedAgain(reason string) error {
	sentinel := ErrInsufficient
	if strings.HasPrefix(reason, ErrUnknownProduct.Error()) {
		sentinel = ErrUnknownProduct
	}
	_, detail, _ := strings.Cut(reason, ": ")
	return outcome.Permanent(fmt.Errorf("%w: %s (already refused before)", sentinel, detail))
}

// clip cuts s to at most 200 bytes on a rune boundary.
func clip(s string) string {
	if len(s) <= 200 {
		return s
	}
	n := 200
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// OrderState returns what inventari did for an order: servida, refusada,
// cancellada or "" (nothing), and the units it took and has not given back.
func (s *Service) OrderState(ctx context.Context, orderID string) (string, map[string]int, error) {
	var (
		state    string
		lines    []byte
		restored bool
	)
	err := s.cfg.Pool.QueryRow(ctx, `SELECT estat, linies, restaurada FROM comandes_estoc WHERE comanda_id = $1`, orderID).Scan(&state, &lines, &restored)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil, nil
	}
	if err != nil {
		return "", nil, err
	}
	held := map[string]int{}
	if state == stateServed {
		var ls []Line
		if err := json.Unmarshal(lines, &ls); err != nil {
			return "", nil, err
		}
		for _, l := range ls {
			held[l.Product] += l.Quantity
		}
	}
	return state, held, nil
}
