package demo

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
)

// Cheese is the product the demo orders more of than exists.
const Cheese = "formatge-curat"

// CheesePerOrder is the units of Cheese each cheese order asks for.
const CheesePerOrder = 2

// UncoveredCity is a delivery city Quilòmetre Zero does not serve: comandes
// refuses its orders at creation (422 ciutat_no_coberta).
const UncoveredCity = "Perpinyà"

// WithdrawnCity is the city the in-process demo adds to repartiment's
// coverage before the drive (without couriers: its paid orders wait as
// pendent) and withdraws after it: its accepted orders are rejected by
// repartiment (repartiment.rebutjat), then cancelled and refunded.
const WithdrawnCity = "Portbou"

var (
	prices   = map[string]int64{"tomaquet-rosa": 350, "carbasso": 300, "formatge-fresc": 900, "vi-crianca": 1250, Cheese: 1450}
	plentys  = []string{"carbasso", "formatge-fresc", "tomaquet-rosa", "vi-crianca"}
	postcode = map[string]string{"girona": "17001", "barcelona": "08001", "tarragona": "43001", "lleida": "25001", "vic": "08500", "figueres": "17600"}
)

// planned is one order the scenario submits.
type planned struct {
	num       int
	order     comandes.Order
	body      []byte
	key       string // Idempotency-Key
	duplicate bool   // submitted twice with the same key
	invalid   bool   // expected 400
	refused   bool   // expected 402 (only with authorisation)
	cheese    bool   // asks for formatge-curat
	uncovered bool   // delivery city not covered
	legacy    bool   // no address: comanda.creada / comanda.pagada versio 1
	cancel    bool   // cancelled by the client right after its 201
	late      bool   // cancelled once the system has settled: paid, assigned a courier
	withdrawn bool   // to WithdrawnCity (markWithdrawn): accepted, then rejected and compensated
}

// Scenario rules, by order number.
func isDuplicate(n int) bool { return n%10 == 5 }
func isInvalid(n int) bool   { return n%97 == 13 }
func isCheese(n int) bool    { return n%25 == 3 }
func isUncovered(n int) bool { return n%40 == 7 }
func isLegacy(n int) bool    { return n%30 == 11 && !isUncovered(n) }
func isRefused(n int) bool   { return n%101 == 17 }

// isCancelled: the client cancels these orders right after the 201, while
// their consumers are still at work on the creation. n%34 == 17 are orders
// whose first charge attempt fails (gatewayFails): their cancellation is
// handled while the charge waits for its retry. Cheese, uncovered and legacy
// orders are not cancelled by the client (their own outcomes are checked
// apart; a cheese order refused for stock is cancelled by the compensation).
func isCancelled(n int) bool { return n%19 == 4 || n%34 == 17 }

// isCancelledLate: the client cancels these once everything settled (paid,
// courier assigned): the courier is released, the charge refunded.
func isCancelledLate(n int) bool { return n%53 == 9 }

// GatewayFails: the gateway answers 503 to the first charge attempt of these orders.
func gatewayFails(n, attempt int) bool { return attempt == 1 && n%17 == 0 }

// GatewayHangs: the gateway charges, then hangs past the client's timeout, on
// the first attempt of these orders.
func gatewayHangs(n, attempt int) bool { return attempt == 1 && n%29 == 0 && n%17 != 0 }

// mapsFails: the maps service answers 503 to the first request of these orders.
func mapsFails(n, attempt int) bool { return attempt == 1 && n%23 == 0 }

// orderNum extracts N from "...P-2026-00000N".
func orderNum(s string) int {
	i := strings.LastIndexByte(s, '-')
	n, _ := strconv.Atoi(s[i+1:])
	return n
}

// makePlan builds n orders deterministically from seed.
func makePlan(n int, seed uint64, run string, authorize bool) []*planned {
	rng := rand.New(rand.NewPCG(seed, 0x6b6d30))
	out := make([]*planned, 0, n)
	for num := 1; num <= n; num++ {
		market := comandes.MarketsDefault[num%len(comandes.MarketsDefault)]
		p := &planned{num: num, key: fmt.Sprintf("demo-%s-%d", run, num), duplicate: isDuplicate(num)}
		o := comandes.Order{ID: fmt.Sprintf("P-2026-%06d", num), Client: fmt.Sprintf("client-%03d", rng.IntN(300)), Market: market}
		for _, i := range rng.Perm(len(plentys))[:1+rng.IntN(3)] {
			prod := plentys[i]
			o.Lines = append(o.Lines, comandes.Line{Product: prod, Quantity: 1 + rng.IntN(3), PriceCents: prices[prod]})
		}
		switch {
		case isInvalid(num):
			p.invalid = true
			o.Lines[0].Quantity = 0
		case authorize && isRefused(num):
			p.refused = true
			o.Lines = append(o.Lines, comandes.Line{Product: "vi-crianca", Quantity: 200, PriceCents: prices["vi-crianca"]})
		case isCheese(num):
			p.cheese = true
			o.Lines = append(o.Lines, comandes.Line{Product: Cheese, Quantity: CheesePerOrder, PriceCents: prices[Cheese]})
		}
		switch {
		case isUncovered(num):
			p.uncovered = true
			o.Address = &comandes.Address{City: UncoveredCity, PostalCode: "66000"}
		case isLegacy(num):
			p.legacy = true
		default:
			o.Address = &comandes.Address{City: strings.ToUpper(market[:1]) + market[1:], PostalCode: postcode[market]}
		}
		normal := !p.invalid && !p.refused && !p.cheese && !p.uncovered && !p.legacy && !p.duplicate
		p.cancel = isCancelled(num) && normal
		p.late = isCancelledLate(num) && normal && !p.cancel
		p.order = o
		p.body, _ = json.Marshal(o)
		out = append(out, p)
	}
	return out
}

// isWithdrawn: orders to WithdrawnCity (markWithdrawn).
func isWithdrawn(n int) bool { return n%40 == 27 }

// markWithdrawn sends the plain orders isWithdrawn picks to WithdrawnCity.
// Only the in-process demo calls it: it changes repartiment's coverage.
func markWithdrawn(plan []*planned) {
	for _, p := range plan {
		if !isWithdrawn(p.num) || p.invalid || p.refused || p.cheese || p.uncovered || p.legacy || p.duplicate || p.cancel || p.late {
			continue
		}
		p.withdrawn = true
		p.order.Address = &comandes.Address{City: WithdrawnCity, PostalCode: "17497"}
		p.body, _ = json.Marshal(p.order)
	}
}

// restockFor returns the units to add to each plentiful product so that the
// expected accepted orders never run out of it: only the cheese runs out.
func restockFor(plan []*planned) map[string]int {
	demand := map[string]int{}
	for _, p := range plan {
		if p.invalid || p.refused {
			continue
		}
		for _, l := range p.order.Lines {
			demand[l.Product] += l.Quantity
		}
	}
	out := map[string]int{}
	for _, prod := range plentys {
		if extra := demand[prod] - inventari.InitialStock[prod]; extra > 0 {
			out[prod] = extra
		}
	}
	return out
}
