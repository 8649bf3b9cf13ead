// Package repartiment is the delivery service of Quilòmetre Zero (failure
// classification). It assigns a courier to each comanda.pagada and handles every
// row of CONTRACT.md's failure table:
//
//	maps service answers 503                 → outcome.Transient: retry with backoff, then DLQ
//	delivery city not covered                → decision + repartiment.rebutjat committed, then
//	                                           outcome.Permanent "ciutat_no_coberta: …" (DLQ);
//	                                           Final: it never blocks the order's key
//	adreca_lliurament missing in versio 1    → alert committed, then outcome.Permanent "esquema: …"
//	database refuses connections             → transient (Classifier), retry with backoff
//	no courier free right now                → delivery persisted as 'pendent', ack;
//	                                           RunAssigner assigns it later
//
// The covered cities (ciutats.coberta, changed with SetCovered) are published
// as repartiment.cobertura snapshots, so that comandes refuses an order to
// an uncovered city at creation without asking repartiment per order.
package repartiment

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
)

// Names of CONTRACT.md.
const (
	Name  = "repartiment"               // origen of its events; database km0_repartiment
	Topic = "repartiment.esdeveniments" // where it publishes
	// TypeOrderPaid is the event it consumes.
	TypeOrderPaid = "comanda.pagada"
	// TypeOrderCancelled is consumed by the same consumer: it releases the courier.
	TypeOrderCancelled = "comanda.cancellada"
	// TypeAssigned is published when a courier is assigned.
	TypeAssigned = "repartiment.assignat"
	// TypeRejected is published when an order cannot be delivered.
	TypeRejected = "repartiment.rebutjat"
	// ConsumerAssign is the consumidor of the comanda.pagada handler.
	ConsumerAssign = "repartiment.assignacio"
	// Aggregate is the outbox agregat; agregat_id is the order id.
	Aggregate = "lliurament"
)

// Dead-letter reasons (the text after "permanent: " in motiu).
const (
	ReasonNotCovered = "ciutat_no_coberta"
	ReasonSchema     = "esquema"
)

// Delivery states.
const (
	StatePending  = "pendent"
	StateAssigned = "assignat"
	StateRejected = "rebutjat"
	// StateCancelled: the order was cancelled; its courier, if any, released.
	StateCancelled = "cancellat"
)

// DeliveryTimeDefault is how long a courier stays busy with one delivery.
const DeliveryTimeDefault = 30 * time.Minute

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates ciutats, repartidors (seeded), lliuraments and alertes.
// Apply it with migrate.Outbox and migrate.Inbox.
var Migrations = migrate.Set{Name: "repartiment", FS: sqlFS, Dir: "sql"}

// Config configures a Service.
type Config struct {
	Pool *pgxpool.Pool // km0_repartiment, migrated; required
	// SidePool commits decisions that must survive a dead-lettered message
	// (the rejection event, the schema alert) in their own transaction. Give it
	// its own small pool so that it never waits for connections held by
	// consumer transactions; required, and it must not be Pool: with a shared
	// pool, every consumer transaction could wait on a second connection at
	// once, and none would ever get one.
	SidePool *pgxpool.Pool
	Outbox   *outbox.Outbox // default outbox.New(outbox.Config{})
	Maps     Maps           // required
	// DeliveryTime: a courier is busy this long per delivery. Default DeliveryTimeDefault.
	DeliveryTime time.Duration
	Logger       *slog.Logger // default slog.Default()
}

// Service is the repartiment service. It is safe for concurrent use.
type Service struct {
	cfg    Config
	alerts atomic.Int64
}

// New returns a Service; it fails without a pool, a separate side pool, or maps.
func New(cfg Config) (*Service, error) {
	if cfg.Pool == nil || cfg.Maps == nil {
		return nil, errors.New("repartiment: Config.Pool and Config.Maps are required")
	}
	if cfg.SidePool == nil || cfg.SidePool == cfg.Pool {
		return nil, errors.New("repartiment: Config.SidePool is required and must be a pool of its own (see its doc)")
	}
	if cfg.Outbox == nil {
		cfg.Outbox = outbox.New(outbox.Config{})
	}
	if cfg.DeliveryTime <= 0 {
		cfg.DeliveryTime = DeliveryTimeDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Service{cfg: cfg}, nil
}

type address struct {
	City       string `json:"ciutat"`
	PostalCode string `json:"codi_postal"`
}

// orderPaid is the part of comanda.pagada (schemas/comanda.pagada/v1.json) repartiment reads.
type orderPaid struct {
	ID      string   `json:"comanda_id"`
	Address *address `json:"adreca_lliurament"`
}

// Assigned is the dades of repartiment.assignat.
type Assigned struct {
	OrderID  string `json:"comanda_id"`
	Courier  string `json:"repartidor"`
	City     string `json:"ciutat"`
	Minutes  int    `json:"minuts_estimats"`
	WasQueue bool   `json:"despres_d_esperar"`
}

// Rejected is the dades of repartiment.rebutjat.
type Rejected struct {
	OrderID string `json:"comanda_id"`
	City    string `json:"ciutat"`
	Reason  string `json:"motiu"`
}

// HandleOrderPaid is the consumer.Handler of comanda.pagada (consumidor
// ConsumerAssign). See the package doc for what each failure becomes.
func (s *Service) HandleOrderPaid(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var o orderPaid
	if err := strictjson.Unmarshal(m.Envelope.Data, &o); err != nil || o.ID == "" {
		return s.schemaFailure(ctx, m, fmt.Sprintf("comanda.pagada unreadable or without comanda_id: %v", err))
	}
	if o.Address == nil || strings.TrimSpace(o.Address.City) == "" {
		return s.schemaFailure(ctx, m, fmt.Sprintf("adreca_lliurament missing in comanda.pagada versio %d (%s)", m.Envelope.Version, o.ID))
	}
	// Cancelled first (the cancellation overtook this message's retry):
	// nothing to assign, nothing to reject.
	if gone, err := cancelled(ctx, tx, o.ID); err != nil || gone {
		return err
	}
	city := normalize(o.Address.City)
	// FOR SHARE: a SetCovered of this city waits for this transaction, so
	// the pendent row written below is rejected by it if it withdraws the city.
	var covered bool
	err := tx.QueryRow(ctx, `SELECT coberta FROM ciutats WHERE ciutat = $1 FOR SHARE`, city).Scan(&covered)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	if !covered {
		return s.reject(ctx, o.ID, city)
	}
	// Another event for an order already handled (a second comanda.pagada)
	// changes nothing: answer before asking maps, whose outage would
	// otherwise retry and dead-letter a no-op.
	var handled bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM lliuraments WHERE comanda_id = $1)`, o.ID).Scan(&handled); err != nil {
		return err
	}
	if handled {
		return nil
	}
	minutes, err := s.cfg.Maps.Route(ctx, o.ID, city, o.Address.PostalCode)
	if err != nil {
		// 503, timeout, no connection: transient. Anything else from maps too:
		// its own failures are not the order's fault.
		return outcome.Transient(fmt.Errorf("mapes: %s: %w", o.ID, err))
	}
	tag, err := tx.Exec(ctx, `INSERT INTO lliuraments (comanda_id, ciutat, codi_postal, estat, minuts_estimats)
		VALUES ($1, $2, $3, 'pendent', $4) ON CONFLICT (comanda_id) DO NOTHING`, o.ID, city, o.Address.PostalCode, minutes)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return nil // already handled (another event for the same order)
	}
	// No courier free: the row stays 'pendent', the message is acked, and
	// RunAssigner picks it up later.
	_, err = s.tryAssign(ctx, tx, o.ID, city, minutes, false)
	return err
}

// tryAssign assigns a free courier of city to orderID in tx and writes
// repartiment.assignat; it reports false when none is free.
func (s *Service) tryAssign(ctx context.Context, tx pgx.Tx, orderID, city string, minutes int, waited bool) (bool, error) {
	var courier string
	err := tx.QueryRow(ctx, `SELECT id FROM repartidors WHERE ciutat = $1 AND (ocupat_fins IS NULL OR ocupat_fins <= now())
		ORDER BY ocupat_fins NULLS FIRST, id LIMIT 1 FOR UPDATE SKIP LOCKED`, city).Scan(&courier)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, `UPDATE repartidors SET ocupat_fins = now() + $2::interval WHERE id = $1`,
		courier, fmt.Sprintf("%d microseconds", s.cfg.DeliveryTime.Microseconds())); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, `UPDATE lliuraments SET estat = 'assignat', repartidor_id = $2, assignat_en = now() WHERE comanda_id = $1`, orderID, courier); err != nil {
		return false, err
	}
	return true, s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: Aggregate, AggregateID: orderID, Type: TypeAssigned,
		Payload: Assigned{OrderID: orderID, Courier: courier, City: city, Minutes: minutes, WasQueue: waited}})
}

// reject commits the decision and repartiment.rebutjat in a transaction of
// its own, once per order, and returns the permanent error that sends the
// message to the DLQ. The consumer rolls its own transaction back on a
// permanent error; the decision must outlive that. If the process dies after
// this commit and before the DLQ copy is written, the redelivery finds the
// decision, writes no second event, and dead-letters again. If the decision
// cannot be committed (database down), the error is transient: the message is
// never dead-lettered without its rejection event.
func (s *Service) reject(ctx context.Context, orderID, city string) error {
	err := pgx.BeginFunc(ctx, s.cfg.SidePool, func(side pgx.Tx) error {
		tag, err := side.Exec(ctx, `INSERT INTO lliuraments (comanda_id, ciutat, estat, motiu) VALUES ($1, $2, 'rebutjat', $3)
			ON CONFLICT (comanda_id) DO NOTHING`, orderID, city, ReasonNotCovered)
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		return s.cfg.Outbox.Enqueue(ctx, side, &outbox.Event{Aggregate: Aggregate, AggregateID: orderID, Type: TypeRejected,
			Payload: Rejected{OrderID: orderID, City: city, Reason: ReasonNotCovered}})
	})
	if err != nil {
		return outcome.Transient(fmt.Errorf("repartiment: record rejection of %s: %w", orderID, err))
	}
	return outcome.Permanent(fmt.Errorf("%w: %s (%s)", ErrNotCovered, city, orderID))
}

// schemaFailure raises the alert (logged, and committed once per event in
// alertes) and returns the permanent "esquema: …" error.
func (s *Service) schemaFailure(ctx context.Context, m *consumer.Message, detail string) error {
	s.alerts.Add(1)
	s.cfg.Logger.Error("ALERT repartiment: an event that breaks the contract", "id_esdeveniment", m.Envelope.ID, "detall", detail)
	if _, err := s.cfg.SidePool.Exec(ctx, `INSERT INTO alertes (id_esdeveniment, tipus, detall) VALUES ($1, $2, $3)
		ON CONFLICT DO NOTHING`, m.Envelope.ID, ReasonSchema, detail); err != nil {
		return outcome.Transient(fmt.Errorf("repartiment: record alert: %w", err))
	}
	return outcome.Permanentf("%s: %s", ReasonSchema, detail)
}

// Alerts returns how many schema alerts this process raised.
func (s *Service) Alerts() int64 { return s.alerts.Load() }

// AssignPending assigns couriers to pending deliveries, oldest first, as far
// as couriers are free, and returns how many it assigned. Several assigners
// may run at once (SKIP LOCKED).
func (s *Service) AssignPending(ctx context.Context) (int, error) {
	assigned := 0
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		// Only cities with a courier free now: a backlog in a busy city must
		// not fill the batch and starve the others.
		rows, err := tx.Query(ctx, `SELECT l.comanda_id, l.ciutat, coalesce(l.minuts_estimats, 0) FROM lliuraments l WHERE l.estat = 'pendent'
			AND EXISTS (SELECT 1 FROM repartidors r WHERE r.ciutat = l.ciutat AND (r.ocupat_fins IS NULL OR r.ocupat_fins <= now()))
			ORDER BY l.creat_en LIMIT 50 FOR UPDATE OF l SKIP LOCKED`)
		if err != nil {
			return err
		}
		type pending struct {
			id, city string
			minutes  int
		}
		list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pending, error) {
			var p pending
			return p, r.Scan(&p.id, &p.city, &p.minutes)
		})
		if err != nil {
			return err
		}
		full := map[string]bool{}
		for _, p := range list {
			if full[p.city] {
				continue
			}
			ok, err := s.tryAssign(ctx, tx, p.id, p.city, p.minutes, true)
			if err != nil {
				return err
			}
			if ok {
				assigned++
			} else {
				full[p.city] = true
			}
		}
		return nil
	})
	return assigned, err
}

// RunAssigner calls AssignPending every interval until ctx ends. Errors are
// logged and retried at the next tick. It returns ctx.Err().
func (s *Service) RunAssigner(ctx context.Context, interval time.Duration) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			if n, err := s.AssignPending(ctx); err != nil && ctx.Err() == nil {
				s.cfg.Logger.Warn("repartiment: periodic assigner", "err", err)
			} else if n > 0 {
				s.cfg.Logger.Debug("repartiment: assigned pending deliveries", "n", n)
			}
		}
	}
}

// Classifier is the consumer's outcome.Classifier for repartiment. A
// database that refuses connections (restarting), a network error or any
// other unclassified error is transient: retry with backoff. Only errors that
// say the data itself is bad (PostgreSQL class 22 data exception, class 23
// integrity violation) are permanent.
func Classifier(err error) outcome.Kind {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")) {
		return outcome.KindPermanent
	}
	return outcome.KindTransient
}

// Summary counts deliveries by state.
func (s *Service) Summary(ctx context.Context) (map[string]int, error) {
	rows, err := s.cfg.Pool.Query(ctx, `SELECT estat, count(*) FROM lliuraments GROUP BY estat`)
	if err != nil {
		return nil, err
	}
	out := map[string]int{StatePending: 0, StateAssigned: 0, StateRejected: 0, StateCancelled: 0}
	var (
		st string
		n  int
	)
	_, err = pgx.ForEachRow(rows, []any{&st, &n}, func() error { out[st] = n; return nil })
	return out, err
}

// Handler returns GET /lliuraments → {"pendent": n, "assignat": n, "rebutjat": n, "cancellat": n}.
func (s *Service) Handler() http.Handler {
	return svc.GetJSON("/lliuraments", "could not read the deliveries", func(ctx context.Context) (any, error) { return s.Summary(ctx) })
}

func normalize(city string) string { return NormalizeCity(city) }
