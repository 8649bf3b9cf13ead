package demo

import (
	"context"
	"fmt"

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
	Cancelled           int            `json:"cancellades"`
	ByReason            map[string]int `json:"per_motiu"`
	Charged             int            `json:"cobrades"`                      // cancelled orders the gateway had charged
	ChargedUnbooked     int            `json:"cobrades_sense_pagament"`       // of those, charged by an attempt that timed out: no payment recorded
	Refunded            int            `json:"reemborsades"`                  // charged, then refunded once
	NeverCharged        int            `json:"mai_cobrades"`                  // cancelled before the charge (its creation in retry): nothing to refund
	Owed                int            `json:"cobrades_sense_reemborsar"`     // must be 0
	RefundWrong         int            `json:"reemborsaments_incorrectes"`    // another amount, twice, or of an order not cancelled: must be 0
	StockHeld           int            `json:"estoc_retingut"`                // cancelled orders whose units inventari still holds: must be 0
	StockRestored       int            `json:"estoc_retornat"`                // cancelled orders whose units inventari gave back
	Tombstones          int            `json:"cancellacio_abans_que_creacio"` // cancellations inventari saw before the order: it took nothing
	CourierHeld         int            `json:"repartidors_retinguts"`         // must be 0
	Released            int            `json:"repartidors_alliberats"`
	RefusedNotCancelled int            `json:"refusades_sense_cancellar"`  // orders refused for stock not cancelled: must be 0
	UnplannedCancel     int            `json:"cancellacions_no_previstes"` // must be 0
	// Rejected are the orders repartiment rejected (repartiment.rebutjat,
	// delivery estat rebutjat): each must be cancelled (motiu
	// ciutat_no_coberta) and refunded, or never charged.
	Rejected             int `json:"rebutjades_repartiment"`
	RejectedNotCancelled int `json:"rebutjades_sense_cancellar"` // must be 0
	RejectedCharged      int `json:"rebutjades_cobrades"`        // rejected and still charged (not refunded once): must be 0

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
	return fmt.Sprintf("%d cancel·lades %v: %d reemborsades un cop (%d cobrades per un intent que va expirar, sense pagament desat), %d mai cobrades (cancel·lades mentre el cobrament esperava el reintent), %d cobrades sense reemborsar, %d reemborsaments incorrectes; estoc retornat a %d, %d cancel·lacions abans que la creació, %d amb estoc retingut; %d repartidors alliberats, %d retinguts; %d refusades per estoc sense cancel·lar, %d cancel·lacions no previstes",
		c.Cancelled, c.ByReason, c.Refunded, c.ChargedUnbooked, c.NeverCharged, c.Owed, c.RefundWrong, c.StockRestored, c.Tombstones, c.StockHeld, c.Released, c.CourierHeld, c.RefusedNotCancelled, c.UnplannedCancel)
}
