// Package inventari is the stock service of Quilòmetre Zero. It consumes
// comanda.creada idempotently (consumidor inventari.descompte_estoc), never
// lets stock go negative, dead-letters an order it cannot serve, and publishes
// estoc.actualitzat through its own outbox in the same transaction (the
// transactional outbox). ReservarEstoc is its request/reply operation, idempotent
// by id_reserva.
package inventari

import (
	"cmp"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/inbox"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
	"github.com/km0/km0/requestreply"
)

// Names of CONTRACT.md.
const (
	Name  = "inventari"               // origen of its events; database km0_inventari
	Topic = "inventari.esdeveniments" // where it publishes
	// TypeStockUpdated is published for every change of a product's stock.
	TypeStockUpdated = "estoc.actualitzat"
	// TypeOrderCreated is the event it consumes.
	TypeOrderCreated = "comanda.creada"
	// TypeOrderCancelled is consumed by the same consumer: it gives back the
	// stock its order took.
	TypeOrderCancelled = "comanda.cancellada"
	// TypeStockRefused is published once per order refused for stock: the
	// compensation's first step (comandes cancels the order).
	TypeStockRefused = "estoc.refusat"
	// ConsumerDecrement is the consumidor of the comanda.creada handler.
	ConsumerDecrement = "inventari.descompte_estoc"
	// ConsumerReserve is the consumidor under which ReservarEstoc records id_reserva.
	ConsumerReserve = "inventari.reserva"
	// Aggregate is the outbox agregat of estoc.actualitzat; agregat_id is the product.
	Aggregate = "producte"
	// AggregateOrder is the agregat of estoc.refusat; agregat_id is the order.
	AggregateOrder = "comanda"
	// ReserveQueue is the request/reply service name of ReservarEstoc.
	ReserveQueue = "inventari.reserves"
)

// Reasons (motiu) of estoc.actualitzat.
const (
	ReasonOrder   = "comanda"
	ReasonReserve = "reserva"
	ReasonRestock = "reposicio"
	ReasonCancel  = "cancellacio" // stock given back by a cancelled order
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates and seeds estoc and creates reserves. Apply it with
// migrate.Outbox and migrate.Inbox.
var Migrations = migrate.Set{Name: "inventari", FS: sqlFS, Dir: "sql"}

// ConsumerBatchSize is the consumer.Config.BatchSize the comanda.creada
// consumer runs with. Every batch locks the rows of the products it touches
// until it commits, and with the contract's five products nearly every batch
// touches all of them, so batches of the two partitions' workers take turns:
// the rate is about BatchSize orders per lock hold (the UPDATE, the outbox
// insert and the COMMIT's WAL flush). A batch is only as large as what is
// queued, so when idle it is one order and costs no latency.
const ConsumerBatchSize = 1000

// InitialStock is the initial contents of estoc (CONTRACT.md).
var InitialStock = map[string]int{"tomaquet-rosa": 120, "carbasso": 80, "formatge-curat": 5, "formatge-fresc": 30, "vi-crianca": 200}

// Sentinels of a stock change that cannot be applied; both are permanent.
var (
	ErrInsufficient   = errors.New("estoc_insuficient")
	ErrUnknownProduct = errors.New("producte_desconegut")
)

// Final reports whether err refuses an order for good (insufficient stock,
// an unknown product): a business outcome, recorded and compensated
// (estoc.refusat), not a fault an operator fixes and replays. In per-key
// order (consumer.Config.FinalFailure) such an order is dead-lettered but
// does not block its key, so its cancellation is applied behind it.
func Final(err error) bool {
	return errors.Is(err, ErrInsufficient) || errors.Is(err, ErrUnknownProduct)
}

// StockUpdated is the dades of estoc.actualitzat.
type StockUpdated struct {
	Product string `json:"producte"`
	Before  int    `json:"abans"`
	After   int    `json:"despres"`
	Reason  string `json:"motiu"`
	OrderID string `json:"comanda_id,omitempty"`
}

// Line is one product and quantity to take from stock.
type Line struct {
	Product  string `json:"producte"`
	Quantity int    `json:"quantitat"`
}

// Config configures a Service.
type Config struct {
	Pool   *pgxpool.Pool  // km0_inventari, migrated; required
	Outbox *outbox.Outbox // default outbox.New(outbox.Config{})
	Inbox  *inbox.Inbox   // for ReservarEstoc; default inbox.New(inbox.Config{})
	Logger *slog.Logger   // default slog.Default()
}

// Service is the inventari service. It is safe for concurrent use.
type Service struct{ cfg Config }

// New returns a Service; it fails without a pool.
func New(cfg Config) (*Service, error) {
	if cfg.Pool == nil {
		return nil, errors.New("inventari: Config.Pool is required")
	}
	if cfg.Outbox == nil {
		cfg.Outbox = outbox.New(outbox.Config{})
	}
	if cfg.Inbox == nil {
		cfg.Inbox = inbox.New(inbox.Config{})
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg}, nil
}

type orderCreated struct {
	ID    string `json:"id"`
	Lines []Line `json:"linies"`
}

// HandleOrderCreated is the consumer.Handler of comanda.creada and
// comanda.cancellada (consumidor ConsumerDecrement): HandleOrdersCreated on a
// batch of one. As a Handler its refusal rolls back the transaction, and
// estoc.refusat with it: wire HandleOrdersCreated as HandleBatchOutcomes
// for the compensation (the system does). In the
// consumer's transaction, which also holds the idempotency key, it takes each
// line from stock and writes one estoc.actualitzat per product. Insufficient
// stock or an unknown product is outcome.Permanent ("estoc_insuficient: …",
// "producte_desconegut: …") and changes nothing; returned by a Handler, it
// rolls the key back too: the order goes to the DLQ.
func (s *Service) HandleOrderCreated(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	outcomes, err := s.HandleOrdersCreated(ctx, tx, []*consumer.Message{m})
	if err != nil {
		return err
	}
	return outcomes[0]
}

// take decrements every line in tx, in product order (two transactions never
// wait for each other's rows in opposite orders: no deadlock), and enqueues one
// estoc.actualitzat per product. It returns the changes it made.
func (s *Service) take(ctx context.Context, tx pgx.Tx, lines []Line, reason, orderID string) ([]StockUpdated, error) {
	lines, err := sumLines(lines)
	if err != nil {
		return nil, err
	}
	changes := make([]StockUpdated, 0, len(lines))
	events := make([]*outbox.Event, 0, len(lines))
	for _, l := range lines {
		p, q := l.Product, l.Quantity
		var after int
		err := tx.QueryRow(ctx, `UPDATE estoc SET unitats = unitats - $1 WHERE producte = $2 AND unitats >= $1 RETURNING unitats`, q, p).Scan(&after)
		if errors.Is(err, pgx.ErrNoRows) {
			var have int
			if err := tx.QueryRow(ctx, `SELECT unitats FROM estoc WHERE producte = $1`, p).Scan(&have); errors.Is(err, pgx.ErrNoRows) {
				return nil, outcome.Permanent(fmt.Errorf("%w: %s", ErrUnknownProduct, p))
			} else if err != nil {
				return nil, err
			}
			return nil, outcome.Permanent(fmt.Errorf("%w: %s (%d left, %d asked)", ErrInsufficient, p, have, q))
		}
		if err != nil {
			return nil, err
		}
		c := StockUpdated{Product: p, Before: after + q, After: after, Reason: reason, OrderID: orderID}
		changes = append(changes, c)
		events = append(events, &outbox.Event{Aggregate: Aggregate, AggregateID: p, Type: TypeStockUpdated, Payload: c})
	}
	if err := s.cfg.Outbox.EnqueueBatch(ctx, tx, events); err != nil {
		return nil, err
	}
	return changes, nil
}

// ReserveRequest is the body of ReservarEstoc.
type ReserveRequest struct {
	ID    string `json:"id_reserva"`
	Lines []Line `json:"linies"`
}

// ReserveResponse is the answer of ReservarEstoc.
type ReserveResponse struct {
	ID       string         `json:"id_reserva"`
	Accepted bool           `json:"acceptada"`
	Reason   string         `json:"motiu,omitempty"`
	Changes  []StockUpdated `json:"canvis,omitempty"`
}

// Reserve is ReservarEstoc: it takes the lines from stock (writing
// estoc.actualitzat) or refuses for lack of stock, and stores the answer under
// id_reserva, recorded in missatges_processats as ConsumerReserve, all in one
// transaction. A repeated id_reserva returns the stored answer and changes
// nothing, so a requester that timed out can safely ask again. A malformed
// body, or an id_reserva over requestreply.MaxIDBytesDefault bytes, not UTF-8
// or with control characters, is an outcome.Permanent error.
func (s *Service) Reserve(ctx context.Context, body []byte) ([]byte, error) {
	var req ReserveRequest
	if err := strictjson.Unmarshal(body, &req); err != nil {
		return nil, outcome.Permanentf("esquema: ReservarEstoc: %v", err)
	}
	if req.ID == "" || len(req.Lines) == 0 {
		return nil, outcome.Permanentf("esquema: ReservarEstoc without id_reserva or linies")
	}
	// Checked before any SQL: a bad id is a clear refusal, never a database error.
	if err := requestreply.CheckID("esquema: ReservarEstoc: id_reserva", req.ID, 0); err != nil {
		return nil, err
	}
	tx, err := s.cfg.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	var answer []byte
	res, err := s.cfg.Inbox.ProcessTx(ctx, tx, ConsumerReserve, req.ID, func(tx pgx.Tx) error {
		resp := ReserveResponse{ID: req.ID, Accepted: true}
		if _, err := tx.Exec(ctx, "SAVEPOINT reserva"); err != nil {
			return err
		}
		changes, err := s.take(ctx, tx, req.Lines, ReasonReserve, "")
		switch {
		case errors.Is(err, ErrInsufficient), errors.Is(err, ErrUnknownProduct):
			if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT reserva"); err != nil {
				return err
			}
			resp = ReserveResponse{ID: req.ID, Reason: err.Error()}
		case err != nil:
			return err
		default:
			resp.Changes = changes
		}
		body, _ := json.Marshal(resp)
		// The answer is returned as stored, so a repeat gets the same bytes.
		return tx.QueryRow(ctx, `INSERT INTO reserves (id_reserva, resposta) VALUES ($1, $2) RETURNING resposta::text`, req.ID, string(body)).Scan(&answer)
	})
	if err != nil {
		return nil, err
	}
	if res == inbox.Duplicate {
		if err := tx.QueryRow(ctx, `SELECT resposta::text FROM reserves WHERE id_reserva = $1`, req.ID).Scan(&answer); err != nil {
			return nil, fmt.Errorf("inventari: stored answer of %s: %w", req.ID, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, err
	}
	return answer, nil
}

// Restock adds units of product (creating it if unknown) and writes
// estoc.actualitzat with motiu "reposicio" in the same transaction.
func (s *Service) Restock(ctx context.Context, product string, units int) error {
	if product == "" || units <= 0 {
		return fmt.Errorf("inventari: restock %q by %d: need a product and positive units", product, units)
	}
	return pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		var after int
		if err := tx.QueryRow(ctx, `INSERT INTO estoc (producte, unitats) VALUES ($1, $2)
			ON CONFLICT (producte) DO UPDATE SET unitats = estoc.unitats + EXCLUDED.unitats RETURNING unitats`, product, units).Scan(&after); err != nil {
			return err
		}
		return s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: Aggregate, AggregateID: product, Type: TypeStockUpdated,
			Payload: StockUpdated{Product: product, Before: after - units, After: after, Reason: ReasonRestock}})
	})
}

// Stock returns the units of every product.
func (s *Service) Stock(ctx context.Context) (map[string]int, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT producte, unitats FROM estoc`)
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	var (
		p string
		n int
	)
	_, err = pgx.ForEachRow(rows, []any{&p, &n}, func() error { out[p] = n; return nil })
	return out, err
}

// Handler returns the HTTP API: GET /estoc → [{"producte", "unitats"}], by product.
func (s *Service) Handler() http.Handler {
	return svc.GetJSON("/estoc", "could not read the stock", func(ctx context.Context) (any, error) {
		st, err := s.Stock(ctx)
		if err != nil {
			return nil, err
		}
		type item struct {
			Product string `json:"producte"`
			Units   int    `json:"unitats"`
		}
		out := make([]item, 0, len(st))
		for p, n := range st {
			out = append(out, item{p, n})
		}
		slices.SortFunc(out, func(a, b item) int { return cmp.Compare(a.Product, b.Product) })
		return out, nil
	})
}
