package lag

import (
	"context"
	"encoding/binary"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
)

// outboxWAL measures a WAL-mode outbox from its replication slot: the bytes
// written and not confirmed, the WAL retained, its status and, when no
// relay streams from it and it holds unconfirmed WAL, the age of the oldest
// unconfirmed message (walOldest).
func (m *Measurer) outboxWAL(ctx context.Context, s *Snapshot, o Outbox) OutboxLag {
	ol := OutboxLag{Name: o.Name}
	slot := o.Slot
	if slot == "" {
		var db string
		if err := o.DB.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			ol.Err = m.fail(s, "outbox "+o.Name, "its database does not answer", err)
			return ol
		}
		slot = migrate.WALSlot(db, o.Names)
	}
	sl := &SlotLag{Slot: slot}
	err := o.DB.QueryRow(ctx, `SELECT active, coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8,
		coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, coalesce(wal_status, '')
		FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()`, slot).
		Scan(&sl.Active, &sl.LagBytes, &sl.RetainedBytes, &sl.WALStatus)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		ol.Err = m.fail(s, "outbox "+o.Name, "its replication slot "+slot+" does not exist (km0 migrate --outbox-mode wal creates it)", err)
		return ol
	case err != nil:
		ol.Err = m.fail(s, "outbox "+o.Name, "its database does not answer", err)
		return ol
	}
	ol.WAL = sl
	if sl.WALStatus == "lost" {
		ol.Err = m.fail(s, "outbox "+o.Name, "its replication slot "+slot+" is invalidated (wal_status lost): events were lost", errors.New("wal_status lost"))
	}
	switch {
	case sl.LagBytes == 0 || sl.WALStatus == "lost":
		sl.OldestKnown = sl.LagBytes == 0 // nothing unconfirmed: age 0
	case sl.Active:
		note(s, noteWALStreaming)
	default:
		// Decoding reads the retained WAL up to the first transaction with
		// a message: bounded as the reads of the oldest Kafka records.
		pctx, cancel := context.WithTimeout(ctx, m.cfg.OldestTimeout)
		at, ok, err := walOldest(pctx, o.DB, slot)
		cancel()
		switch {
		case err != nil: // the relay took the slot meanwhile, its publication has another name, or OldestTimeout passed
			m.cfg.Logger.Debug("lag: peek the WAL outbox's slot", "slot", slot, "err", err)
		case ok:
			ol.OldestSeconds, sl.OldestKnown = max(m.cfg.Now().Sub(at).Seconds(), 0), true
		default: // the unconfirmed WAL holds no message of the outbox's publication
			sl.OldestKnown = true
		}
	}
	return ol
}

// pgEpoch is the origin of PostgreSQL's timestamps.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// walOldest peeks (without consuming anything) the first transaction the
// slot would stream, with pgoutput and the publication of the slot's name
// (km0 migrate's default), and returns its commit time: the BEGIN message's
// timestamp. ok is false when the slot holds no transaction to stream. It
// fails while a relay streams from the slot.
func walOldest(ctx context.Context, db relay.Querier, slot string) (at time.Time, ok bool, err error) {
	var data []byte
	err = db.QueryRow(ctx, `SELECT data FROM pg_logical_slot_peek_binary_changes($1::name, NULL, 1,
		'proto_version', '1', 'publication_names', $1::text, 'messages', 'true') LIMIT 1`, slot).Scan(&data)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, err
	}
	// Begin: 'B', Int64 final LSN, Int64 commit time (µs since 2000-01-01), Int32 xid.
	if len(data) < 17 || data[0] != 'B' {
		return time.Time{}, false, errors.New("lag: the slot's first message is not a BEGIN")
	}
	us := int64(binary.BigEndian.Uint64(data[9:17]))
	return pgEpoch.Add(time.Duration(us) * time.Microsecond), true, nil
}
