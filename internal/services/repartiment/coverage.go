package repartiment

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/outbox"
)

// ErrNotCovered is wrapped by the permanent error of a comanda.pagada whose
// delivery city repartiment does not cover (motiu "permanent:
// ciutat_no_coberta: …"). Final reports it.
var ErrNotCovered = errors.New(ReasonNotCovered)

// Final reports whether err refuses an order's delivery for good (the city
// is not covered): a business outcome, recorded with repartiment.rebutjat and
// compensated by comandes (cancel, refund), not a fault an operator fixes and
// replays. In per-key order (consumer.Config.FinalFailure) such a message is
// still dead-lettered (the contract's "DLQ ciutat_no_coberta + event"), but
// its key does not wait for it: the order's comanda.cancellada behind it is
// applied, not dead-lettered as blocked.
func Final(err error) bool { return errors.Is(err, ErrNotCovered) }

// TypeCoverage is the tipus of the snapshot of covered cities repartiment
// publishes (schemas/repartiment.cobertura/v1.json); comandes keeps a copy
// to refuse an order to an uncovered city at creation.
const TypeCoverage = "repartiment.cobertura"

// CoverageAggregate and CoverageKey are the outbox agregat and agregat_id of
// repartiment.cobertura: one key, so every snapshot goes to one partition
// and consumers see them in order.
const (
	CoverageAggregate = "cobertura"
	CoverageKey       = "repartiment"
)

// Coverage is the dades of repartiment.cobertura: every city repartiment
// delivers to (lower case, sorted) and a revisio that grows with each change
// (unix microseconds, at least the previous one plus 1), so a reader keeps
// the snapshot of the largest revisio it has seen.
type Coverage struct {
	Cities   []string `json:"ciutats"`
	Revision int64    `json:"revisio"`
}

// SetCovered makes repartiment deliver to city (covered true) or stop
// delivering there (false), and publishes the new snapshot
// (repartiment.cobertura) in the same transaction. A city added this way
// has no courier until one is added to repartidors: its orders wait as
// pendent. Withdrawing a city rejects, in the same transaction, every
// delivery of it still pendent (estat rebutjat and one repartiment.rebutjat
// each, which comandes compensates: cancel, refund) and returns how many; a
// comanda.pagada handled later is rejected by HandleOrderPaid. Deliveries
// already assigned are left to their courier. An empty city is an error.
func (s *Service) SetCovered(ctx context.Context, city string, covered bool) (int, error) {
	c := normalize(city)
	if c == "" {
		return 0, errors.New("repartiment: SetCovered: empty city")
	}
	rejected := 0
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT 1 FROM cobertura_publicada FOR UPDATE`); err != nil {
			return err
		}
		// The city's row lock waits for every comanda.pagada of it in flight
		// (HandleOrderPaid reads it FOR SHARE): their pendent rows are
		// committed before the UPDATE below reads them, and later ones see
		// the new coberta.
		if _, err := tx.Exec(ctx, `INSERT INTO ciutats (ciutat, coberta) VALUES ($1, $2)
			ON CONFLICT (ciutat) DO UPDATE SET coberta = excluded.coberta`, c, covered); err != nil {
			return err
		}
		if !covered {
			rows, err := tx.Query(ctx, `UPDATE lliuraments SET estat = 'rebutjat', motiu = $2 WHERE ciutat = $1 AND estat = 'pendent' RETURNING comanda_id`, c, ReasonNotCovered)
			if err != nil {
				return err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			for _, id := range ids {
				if err := s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: Aggregate, AggregateID: id, Type: TypeRejected,
					Payload: Rejected{OrderID: id, City: c, Reason: ReasonNotCovered}}); err != nil {
					return err
				}
			}
			rejected = len(ids)
		}
		_, err := s.publishCoverage(ctx, tx)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("repartiment: set coverage of %s: %w", c, err)
	}
	return rejected, nil
}

// PublishCoverage writes the current snapshot of covered cities
// (repartiment.cobertura) to the outbox and returns it. The system calls it
// at start, so a reader whose copy was lost (a new database) gets one; the
// revisio only grows when the cities changed since the last snapshot.
func (s *Service) PublishCoverage(ctx context.Context) (Coverage, error) {
	var c Coverage
	err := pgx.BeginFunc(ctx, s.cfg.Pool, func(tx pgx.Tx) error {
		var err error
		c, err = s.publishCoverage(ctx, tx)
		return err
	})
	if err != nil {
		return Coverage{}, fmt.Errorf("repartiment: publish coverage: %w", err)
	}
	return c, nil
}

// publishCoverage enqueues the snapshot in tx, under the lock of the
// cobertura_publicada row.
func (s *Service) publishCoverage(ctx context.Context, tx pgx.Tx) (Coverage, error) {
	var (
		c    Coverage
		last []string
	)
	if err := tx.QueryRow(ctx, `SELECT revisio, ciutats FROM cobertura_publicada FOR UPDATE`).Scan(&c.Revision, &last); err != nil {
		return Coverage{}, err
	}
	if err := tx.QueryRow(ctx, `SELECT coalesce(array_agg(ciutat ORDER BY ciutat), '{}') FROM ciutats WHERE coberta`).Scan(&c.Cities); err != nil {
		return Coverage{}, err
	}
	if c.Revision == 0 || !slices.Equal(c.Cities, last) {
		if err := tx.QueryRow(ctx, `UPDATE cobertura_publicada SET ciutats = $1,
			revisio = GREATEST(revisio + 1, (extract(epoch FROM clock_timestamp()) * 1e6)::bigint) RETURNING revisio`, c.Cities).Scan(&c.Revision); err != nil {
			return Coverage{}, err
		}
	}
	return c, s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: CoverageAggregate, AggregateID: CoverageKey, Type: TypeCoverage, Payload: c})
}

// NormalizeCity is how repartiment (and comandes's copy of its coverage)
// compare city names: trimmed, lower case.
func NormalizeCity(city string) string { return strings.ToLower(strings.TrimSpace(city)) }
