package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/km0/km0/migrate"
)

// portBatch is the reference relay's LOT.
const portBatch = 100

// portEnvelope is the reference relay's embolcall dict.
type portEnvelope struct {
	ID      string          `json:"id_esdeveniment"`
	Type    string          `json:"tipus"`
	Version int             `json:"versio"`
	TimeMS  int64           `json:"data_ms"`
	Origin  string          `json:"origen"`
	Data    json.RawMessage `json:"dades"`
}

// runPort is a straight Go port of the reference polling relay, outbox_relay.py (pgx and
// franz-go in place of psycopg and librdkafka): one connection, LOT 100,
// SELECT ... ORDER BY creat_en LIMIT 100 FOR UPDATE SKIP LOCKED, produce each,
// flush, UPDATE ... WHERE id = ANY, commit; sleep 200 ms when idle. With
// untilEmpty it returns at the first empty pass; otherwise when ctx is done.
// It is the baseline of `km0 bench relay --baseline`, not a km0 relay.
func runPort(ctx context.Context, env *benchEnv, names migrate.Names, topic string, untilEmpty bool) error {
	conn, err := env.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	table := pgx.Identifier{names.Schema, names.Outbox}.Sanitize()
	sel := "SELECT id, agregat_id, tipus, versio, carrega, creat_en FROM " + table +
		" WHERE publicat_en IS NULL ORDER BY creat_en LIMIT $1 FOR UPDATE SKIP LOCKED"
	upd := "UPDATE " + table + " SET publicat_en = now() WHERE id = ANY($1)"
	for {
		n, err := portPass(ctx, conn.Conn(), env.cl, sel, upd, topic)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if n == 0 {
			if untilEmpty {
				return nil
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(200 * time.Millisecond): // the reference relay's time.sleep(0.2)
			}
		}
	}
}

func portPass(ctx context.Context, conn *pgx.Conn, cl *kgo.Client, sel, upd, topic string) (int, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	rows, err := tx.Query(ctx, sel, portBatch)
	if err != nil {
		return 0, err
	}
	var ids []uuid.UUID
	var mu sync.Mutex
	var produceErr error
	for rows.Next() {
		var (
			id      uuid.UUID
			agg     string
			e       portEnvelope
			created time.Time
		)
		if err := rows.Scan(&id, &agg, &e.Type, &e.Version, &e.Data, &created); err != nil {
			return 0, err
		}
		e.ID, e.TimeMS, e.Origin = id.String(), created.UnixMilli(), "comandes"
		value, err := json.Marshal(e)
		if err != nil {
			return 0, err
		}
		cl.Produce(ctx, &kgo.Record{Topic: topic, Key: []byte(agg), Value: value, Headers: []kgo.RecordHeader{
			{Key: "tipus", Value: []byte(e.Type)}, {Key: "id_esdeveniment", Value: []byte(e.ID)}}},
			func(_ *kgo.Record, err error) {
				if err != nil {
					mu.Lock()
					produceErr = errors.Join(produceErr, err)
					mu.Unlock()
				}
			})
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if err := cl.Flush(ctx); err != nil { // waits for Kafka's confirmation
		return 0, err
	}
	if produceErr != nil {
		return 0, fmt.Errorf("produce: %w", produceErr)
	}
	if len(ids) > 0 {
		if _, err := tx.Exec(ctx, upd, ids); err != nil {
			return 0, err
		}
	}
	return len(ids), tx.Commit(ctx)
}
