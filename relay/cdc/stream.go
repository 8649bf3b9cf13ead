package cdc

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/km0/km0/outbox"
)

// item is a piece of the stream: rows of one transaction, in order, and, on
// the transaction's last piece, its end position and commit time.
type item struct {
	rows   []outbox.Row
	lsns   []pglogrepl.LSN // WAL mode: each row's message position; nil in table mode
	end    pglogrepl.LSN   // TransactionEndLSN; 0 on a piece that does not end its transaction
	commit time.Time
	xid    uint32 // the transaction's id (Begin), on every piece
}

// itemRows is the most rows of one piece: a large transaction is handed on
// in pieces, and a batch may end inside it.
const itemRows = 500

// receiveWindow is how long one wait for the server lasts before the reader
// looks again whether it owes the server a status update.
const receiveWindow = 100 * time.Millisecond

// reader owns the replication session: it decodes the stream into items
// and reports the confirmed position to the server.
type reader struct {
	r    *Relay
	conn *pgconn.PgConn
	dec  *decoder
	m    *marker
	out  chan item

	cols          []column // reused by parseInsert
	inTx          bool
	cur           item
	lastForwarded pglogrepl.LSN // end of the last transaction handed on
	idleEnd       pglogrepl.LSN // server position of the last keepalive received outside a transaction
	lastSent      pglogrepl.LSN
	lastSentAt    time.Time
}

func newReader(r *Relay, conn *pgconn.PgConn, m *marker, start pglogrepl.LSN) *reader {
	m.confirmed.Store(uint64(start))
	return &reader{r: r, conn: conn, dec: newDecoder(r.cfg.Names, r.cfg.Logger), m: m, out: make(chan item, 64),
		lastForwarded: start, lastSentAt: time.Now()}
}

// window is a receive deadline shared by the waits of receiveWindow.
type window struct {
	ctx    context.Context
	cancel context.CancelFunc
	until  time.Time
}

func (w *window) get(parent context.Context) context.Context {
	if w.ctx == nil || !time.Now().Before(w.until) {
		w.stop()
		w.until = time.Now().Add(receiveWindow)
		w.ctx, w.cancel = context.WithDeadline(parent, w.until)
	}
	return w.ctx
}

func (w *window) stop() {
	if w.cancel != nil {
		w.cancel()
	}
	w.ctx, w.cancel = nil, nil
}

func (rd *reader) run(ctx context.Context) error {
	var w window
	defer w.stop()
	for {
		if err := rd.maybeStatus(); err != nil {
			return err
		}
		rctx := w.get(ctx)
		msg, err := rd.conn.ReceiveMessage(rctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				w.stop()
				continue
			}
			return fmt.Errorf("cdc: replication stream: %w", err)
		}
		switch msg := msg.(type) {
		case *pgproto3.CopyData:
			if err := rd.copyData(ctx, msg.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("cdc: replication stream: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyDone:
			return fmt.Errorf("cdc: the server ended the replication stream")
		}
	}
}

func (rd *reader) copyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("cdc: keepalive: %w", err)
		}
		// Everything before the keepalive's position that the publication
		// holds was sent before it: outside a transaction, nothing more is
		// owed up to there.
		if !rd.inTx {
			rd.idleEnd = max(rd.idleEnd, k.ServerWALEnd)
		}
		if k.ReplyRequested {
			return rd.status()
		}
	case pglogrepl.XLogDataByteID:
		x, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("cdc: xlog data: %w", err)
		}
		return rd.message(ctx, x.WALData)
	}
	return nil
}

func (rd *reader) message(ctx context.Context, data []byte) error {
	if len(data) > 0 && data[0] == byte(pglogrepl.MessageTypeInsert) && !rd.r.cfg.WAL {
		rel, cols, err := parseInsert(data, rd.cols)
		rd.cols = cols
		if err != nil {
			return err
		}
		row, ok, err := rd.dec.insert(rel, cols)
		if err != nil || !ok {
			return err
		}
		rd.cur.rows = append(rd.cur.rows, row)
		if len(rd.cur.rows) >= itemRows {
			piece := rd.cur
			rd.cur = item{commit: piece.commit, xid: piece.xid}
			return rd.forward(ctx, piece)
		}
		return nil
	}
	msg, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("cdc: decode: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.LogicalDecodingMessage:
		if !rd.r.cfg.WAL {
			return nil
		}
		row, ok := rd.walMessage(m)
		if !ok {
			return nil
		}
		rd.cur.rows, rd.cur.lsns = append(rd.cur.rows, row), append(rd.cur.lsns, m.LSN)
		if len(rd.cur.rows) >= itemRows {
			piece := rd.cur
			rd.cur = item{commit: piece.commit, xid: piece.xid}
			return rd.forward(ctx, piece)
		}
	case *pglogrepl.InsertMessage:
		return nil // WAL mode: its publication holds no table
	case *pglogrepl.RelationMessage:
		if rd.r.cfg.WAL {
			return nil
		}
		return rd.dec.relation(m)
	case *pglogrepl.BeginMessage:
		rd.inTx = true
		rd.cur = item{commit: m.CommitTime, xid: m.Xid}
	case *pglogrepl.CommitMessage:
		rd.cur.end, rd.cur.commit = m.TransactionEndLSN, m.CommitTime
		it := rd.cur
		rd.cur = item{}
		rd.inTx = false
		rd.lastForwarded = it.end
		return rd.forward(ctx, it)
	}
	return nil
}

// forward hands it to the pipeline; while the pipeline is busy it keeps the
// server informed (a session that says nothing for wal_sender_timeout is
// cut).
func (rd *reader) forward(ctx context.Context, it item) error {
	select {
	case rd.out <- it:
		return nil
	default:
	}
	t := time.NewTicker(rd.r.cfg.StatusInterval)
	defer t.Stop()
	for {
		select {
		case rd.out <- it:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			if err := rd.status(); err != nil {
				return err
			}
		}
	}
}

// position is what the relay may report as flushed: the marker's confirmed
// position, or, when nothing is in flight (every transaction handed on is
// confirmed and none is open), the server's position of the last keepalive,
// so an idle outbox does not hold WAL back.
func (rd *reader) position() pglogrepl.LSN {
	c := pglogrepl.LSN(rd.m.confirmed.Load())
	if !rd.inTx && c >= rd.lastForwarded && rd.idleEnd > c {
		return rd.idleEnd
	}
	return c
}

func (rd *reader) maybeStatus() error {
	pos := rd.position()
	since := time.Since(rd.lastSentAt)
	if since >= rd.r.cfg.StatusInterval || (pos > rd.lastSent && since >= receiveWindow) {
		return rd.status()
	}
	return nil
}

func (rd *reader) status() error {
	pos := rd.position()
	if err := pglogrepl.SendStandbyStatusUpdate(context.Background(), rd.conn,
		pglogrepl.StandbyStatusUpdate{WALWritePosition: pos}); err != nil {
		return fmt.Errorf("cdc: status update: %w", err)
	}
	rd.lastSent, rd.lastSentAt = pos, time.Now()
	return nil
}

// finalStatus reports the confirmed position once more, after the stream
// stopped, so that a graceful stop leaves the slot where the marks are.
func (rd *reader) finalStatus() {
	_ = rd.status()
}
