package demo

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/repartiment"
)

// Compensation reconciles the cancelled orders of a run: the client's
// cancellations and the orders inventari refused for stock, which the
// compensation cancels and refunds.
type Compensation struct {
	Cancelled           int            `json:"cancelled"`
	ByReason            map[string]int `json:"by_motiu"`
	Charged             int            `json:"charged"`                  // cancelled orders the gateway had charged
	ChargedUnbooked     int            `json:"charged_unbooked"`         // of those, charged by an attempt that timed out: no payment recorded
	Refunded            int            `json:"refunded"`                 // charged, then refunded once
	NeverCharged        int            `json:"never_charged"`            // cancelled before the charge (its creation in retry): nothing to refund
	Owed                int            `json:"owed"`                     // must be 0
	RefundWrong         int            `json:"wrong_refunds"`            // another amount, twice, or of an order not cancelled: must be 0
	StockHeld           int            `json:"stock_held"`               // cancelled orders whose units inventari still holds: must be 0
	StockRestored       int            `json:"stock_restored"`           // cancelled orders whose units inventari gave back
	Tombstones          int            `json:"cancelled_before_created"` // cancellations inventari saw before the order: it took nothing
	CourierHeld         int            `json:"couriers_held"`            // must be 0
	Released            int            `json:"couriers_released"`
	RefusedNotCancelled int            `json:"refused_not_cancelled"`   // orders refused for stock not cancelled: must be 0
	UnplannedCancel     int            `json:"unplanned_cancellations"` // must be 0
	// Rejected are the orders repartiment rejected (repartiment.rebutjat,
	// delivery estat rebutjat): each must be cancelled (motiu
	// ciutat_no_coberta) and refunded, or never charged.
	Rejected             int `json:"rejected"`
	RejectedNotCancelled int `json:"rejected_not_cancelled"` // must be 0
	RejectedCharged      int `json:"rejected_charged"`       // rejected and still charged (not refunded once): must be 0

	cancelled map[string]bool
}

// compensate reads the cancellations from the four databases (the gateway's
// tables live in km0_pagaments, schema passarella).
func compensate(ctx context.Context, pools map[string]*pgxpool.Pool, plan []*planned, refused map[string]bool) (*Compensation, error) {
	c := &Compensation{ByReason: map[string]int{}, cancelled: map[string]bool{}}
	reasons, err := scanPair[string, string](ctx, pools[comandes.Name], `SELECT id, coalesce(motiu_cancellacio, '') FROM comandes WHERE estat = 'cancellada'`)
	if err != nil {
		return nil, err
	}
	planned := map[string]bool{}
	for _, p := range plan {
		if p.cancel || p.late {
			planned[p.order.ID] = true
		}
	}
	rejected, err := scanPair[string, string](ctx, pools[repartiment.Name], `SELECT comanda_id, coalesce(motiu, '') FROM lliuraments WHERE estat = 'rebutjat'`)
	if err != nil {
		return nil, err
	}
	for id, why := range reasons {
		c.Cancelled++
		c.ByReason[why]++
		c.cancelled[id] = true
		_, isRejected := rejected[id]
		if !(planned[id] && why == comandes.ReasonClient) && !(refused[id] && why == inventari.ErrInsufficient.Error()) &&
			!(isRejected && why == comandes.ReasonNotCovered) {
			c.UnplannedCancel++
		}
	}
	c.Rejected = len(rejected)
	for id := range rejected {
		if !c.cancelled[id] {
			c.RejectedNotCancelled++
		}
	}
	for id := range refused {
		if !c.cancelled[id] {
			c.RefusedNotCancelled++
		}
	}
	type money struct {
		cents int64
		ref   string
	}
	scanMoney := func(sql string) (map[string]money, map[string]int, error) {
		rows, err := pools["pagaments"].Query(ctx, sql)
		if err != nil {
			return nil, nil, err
		}
		out, n := map[string]money{}, map[string]int{}
		var (
			id string
			m  money
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &m.cents, &m.ref}, func() error { out[id] = m; n[id]++; return nil })
		return out, n, err
	}
	charges, _, err := scanMoney(`SELECT comanda_id, import_centims, ref FROM passarella.cobraments`)
	if err != nil {
		return nil, err
	}
	refunds, nRefunds, err := scanMoney(`SELECT comanda_id, import_centims, ref_cobrament FROM passarella.reemborsaments WHERE ref_cobrament IS NOT NULL`)
	if err != nil {
		return nil, err
	}
	booked, _, err := scanMoney(`SELECT comanda_id, import_centims, ref_passarella FROM reemborsaments`)
	if err != nil {
		return nil, err
	}
	paid, _, err := scanMoney(`SELECT comanda_id, import_centims, ref_passarella FROM pagaments`)
	if err != nil {
		return nil, err
	}
	for id := range c.cancelled {
		ch, charged := charges[id]
		rf, refunded := refunds[id]
		if charged {
			c.Charged++
			if _, ok := paid[id]; !ok {
				c.ChargedUnbooked++
			}
		}
		if _, isRejected := rejected[id]; isRejected && charged && (!refunded || nRefunds[id] != 1 || rf.cents != ch.cents) {
			c.RejectedCharged++
		}
		switch {
		case !charged && !refunded:
			c.NeverCharged++
		case charged && !refunded:
			c.Owed++
		case charged && refunded && rf.cents == ch.cents && rf.ref == ch.ref && nRefunds[id] == 1 && booked[id].cents == ch.cents:
			c.Refunded++
		default:
			c.RefundWrong++
		}
	}
	for id := range refunds {
		if !c.cancelled[id] {
			c.RefundWrong++
		}
	}
	for id := range rejected {
		if _, charged := charges[id]; charged && !c.cancelled[id] {
			c.RejectedCharged++ // charged, never cancelled: never refunded
		}
	}
	held, err := scanPair[string, string](ctx, pools[inventari.Name], `SELECT comanda_id, estat || CASE WHEN restaurada THEN '+' ELSE '' END FROM comandes_estoc`)
	if err != nil {
		return nil, err
	}
	for id := range c.cancelled {
		switch held[id] {
		case "servida":
			c.StockHeld++
		case "cancellada+":
			c.StockRestored++
		case "cancellada", "":
			if !refused[id] {
				c.Tombstones++ // seen before its order (or the order never reached inventari): nothing taken
			}
		}
	}
	for id, st := range held {
		if st == "cancellada" && !c.cancelled[id] {
			c.UnplannedCancel++ // inventari cancelled an order comandes did not
		}
	}
	deliveries, err := scanPair[string, string](ctx, pools["repartiment"], `SELECT comanda_id, estat || CASE WHEN alliberat THEN '+' ELSE '' END FROM lliuraments`)
	if err != nil {
		return nil, err
	}
	for id := range c.cancelled {
		switch deliveries[id] {
		case "assignat", "pendent":
			c.CourierHeld++
		case "cancellat+":
			c.Released++
		}
	}
	return c, nil
}

// ok reports whether every cancelled order is compensated.
func (c *Compensation) ok() bool {
	return c.Owed == 0 && c.RefundWrong == 0 && c.StockHeld == 0 && c.CourierHeld == 0 && c.RefusedNotCancelled == 0 && c.UnplannedCancel == 0 &&
		c.RejectedNotCancelled == 0 && c.RejectedCharged == 0
}

func (c *Compensation) String() string {
	return fmt.Sprintf("%d cancelled (%s): %d refunded once (%d charged by an attempt that timed out, no payment recorded), %d never charged (cancelled while the charge waited for its retry), %d charged and not refunded, %d wrong refunds; stock given back for %d, %d cancellations before the creation, %d with stock held; %d couriers released, %d held; %d refused for stock and not cancelled, %d unplanned cancellations",
		c.Cancelled, countsText(c.ByReason), c.Refunded, c.ChargedUnbooked, c.NeverCharged, c.Owed, c.RefundWrong, c.StockRestored, c.Tombstones, c.StockHeld, c.Released, c.CourierHeld, c.RefusedNotCancelled, c.UnplannedCancel)
}

// write writes the compensation as tables: cancellations per motiu, then
// what each was compensated with.
func (c *Compensation) write(w io.Writer, tw *tabwriter.Writer) {
	writeCounts(w, tw, "Cancellations per motiu", "orders", c.ByReason)
	writeRows(w, tw, "Compensation of the cancelled orders", [][2]any{
		{"cancelled", c.Cancelled}, {"refunded once", c.Refunded}, {"  of which charged by a timed-out attempt", c.ChargedUnbooked},
		{"never charged", c.NeverCharged}, {"charged, not refunded", c.Owed}, {"wrong refunds", c.RefundWrong},
		{"stock given back", c.StockRestored}, {"cancelled before inventari saw the order", c.Tombstones}, {"stock still held", c.StockHeld},
		{"couriers released", c.Released}, {"couriers still held", c.CourierHeld},
		{"refused for stock, not cancelled", c.RefusedNotCancelled}, {"rejected by repartiment", c.Rejected},
		{"rejected, not cancelled", c.RejectedNotCancelled}, {"rejected, still charged", c.RejectedCharged},
		{"unplanned cancellations", c.UnplannedCancel},
	})
}
