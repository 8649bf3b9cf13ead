// Package comandes is the orders service of Quilòmetre Zero: an HTTP JSON API
// that validates and stores orders and writes comanda.creada through the
// transactional outbox in the same transaction, and the consumer of
// pagament.confirmat that marks an order paid and emits comanda.pagada. It
// keeps a copy of repartiment's coverage (repartiment.cobertura) to refuse an
// order to an uncovered city at creation (422 ciutat_no_coberta), and cancels
// the orders inventari or repartiment refuse (estoc.refusat,
// repartiment.rebutjat) so that they are refunded.
package comandes

import (
	"embed"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/migrate"
)

// Names of CONTRACT.md.
const (
	Name = "comandes" // the service name: origen of its events, km0_comandes
	// Topic is where comandes publishes its events.
	Topic = "comandes.esdeveniments"
	// TypeCreated is published when an order is stored.
	TypeCreated = "comanda.creada"
	// TypePaid is published when pagament.confirmat marks an order paid.
	TypePaid = "comanda.pagada"
	// TypePaymentConfirmed is the event this service consumes.
	TypePaymentConfirmed = "pagament.confirmat"
	// ConsumerPaymentConfirmed is the consumidor of the pagament.confirmat handler.
	ConsumerPaymentConfirmed = "comandes.confirmacio_pagament"
	// TypeCancelled is published when an order is cancelled.
	TypeCancelled = "comanda.cancellada"
	// TypeStockRefused is inventari's refusal of an order: comandes cancels it.
	TypeStockRefused = "estoc.refusat"
	// ConsumerStockRefused is the consumidor of the estoc.refusat handler.
	ConsumerStockRefused = "comandes.refus_estoc"
	// Aggregate is the outbox agregat of every event of this service.
	Aggregate = "comanda"
)

//go:embed sql/*.sql
var sqlFS embed.FS

// Migrations creates comandes, linies_comanda and peticions_idempotents. Apply
// it with migrate.Outbox and migrate.Inbox.
var Migrations = migrate.Set{Name: "comandes", FS: sqlFS, Dir: "sql"}

// MarketsDefault are the markets orders may come from.
var MarketsDefault = []string{"girona", "barcelona", "tarragona", "lleida", "vic", "figueres"}

// ProductsDefault is the catalogue of Config.Products: the products that
// inventari stocks from its first migration (CONTRACT.md's initial stock).
var ProductsDefault = []string{"tomaquet-rosa", "carbasso", "formatge-curat", "formatge-fresc", "vi-crianca"}

// checkProducts returns a *FieldError (codi producte_desconegut) naming the
// first line whose producte is not in the catalogue.
func (s *Service) checkProducts(o *Order) error {
	for i, l := range o.Lines {
		if !s.products[l.Product] {
			return codedf(svc.CodeUnknownProduct, "linies["+itoa(i)+"].producte", "unknown product %q: inventari does not stock it", clip(l.Product))
		}
	}
	return nil
}

// Line is one order line.
type Line struct {
	Product    string `json:"producte"`
	Quantity   int    `json:"quantitat"`
	PriceCents int64  `json:"preu_centims"`
}

// Address is the delivery address (comanda.creada versio 2).
type Address struct {
	City       string `json:"ciutat"`
	PostalCode string `json:"codi_postal"`
}

// Order is the body of POST /comandes and the dades of comanda.creada. Unknown
// JSON members are ignored.
type Order struct {
	ID      string   `json:"id"`
	Client  string   `json:"client"`
	Market  string   `json:"mercat"`
	Lines   []Line   `json:"linies"`
	Address *Address `json:"adreca_lliurament,omitempty"`
}

// Total returns Σ quantitat × preu_centims.
func (o *Order) Total() int64 {
	var t int64
	for _, l := range o.Lines {
		t += int64(l.Quantity) * l.PriceCents
	}
	return t
}

// Version is the versio of the comanda.creada this order produces: 2 with a
// delivery address, 1 for legacy clients without one.
func (o *Order) Version() int {
	if o.Address != nil {
		return 2
	}
	return 1
}

// Paid is the dades of comanda.pagada (versio 1; schemas/comanda.pagada/v1.json):
// the address is there when the order has one.
type Paid struct {
	ID         string   `json:"comanda_id"`
	Client     string   `json:"client"`
	Market     string   `json:"mercat"`
	TotalCents int64    `json:"import_centims"`
	Address    *Address `json:"adreca_lliurament,omitempty"`
}

// PaymentConfirmed is the dades of pagament.confirmat (published by pagaments).
type PaymentConfirmed struct {
	OrderID    string `json:"comanda_id"`
	TotalCents int64  `json:"import_centims"`
	GatewayRef string `json:"ref_passarella"`
}

var (
	idRE      = regexp.MustCompile(`^P-\d{4}-\d{6}$`)
	productRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,63}$`)
	postalRE  = regexp.MustCompile(`^\d{5}$`)
)

// Limits of an order.
const (
	maxLines      = 50
	maxQuantity   = 10_000
	maxPriceCents = 10_000_000
	maxTextLen    = 100
)

// Validate checks o and returns a *FieldError naming the first bad field, or
// nil: codi id_invalid for a malformed id, mercat_desconegut for an unknown
// market, camp_invalid for anything else.
func Validate(o *Order, markets []string) error {
	switch {
	case o.ID == "":
		return fieldf("id", "required")
	case !idRE.MatchString(o.ID):
		return codedf(svc.CodeInvalidID, "id", "%q is not of the form P-YYYY-NNNNNN", clip(o.ID))
	case strings.TrimSpace(o.Client) == "":
		return fieldf("client", "required")
	case len(o.Client) > maxTextLen:
		return fieldf("client", "more than %d bytes", maxTextLen)
	case !storable(o.Client):
		return fieldf("client", "contains a NUL character or invalid UTF-8")
	case o.Market == "":
		return fieldf("mercat", "required")
	}
	if !contains(markets, o.Market) {
		return codedf(svc.CodeUnknownMarket, "mercat", "unknown market %q (known: %s)", clip(o.Market), strings.Join(markets, ", "))
	}
	if len(o.Lines) == 0 {
		return fieldf("linies", "the order has no line")
	}
	if len(o.Lines) > maxLines {
		return fieldf("linies", "more than %d lines", maxLines)
	}
	for i, l := range o.Lines {
		f := func(name string) string { return "linies[" + itoa(i) + "]." + name }
		switch {
		case l.Product == "":
			return fieldf(f("producte"), "required")
		case !productRE.MatchString(l.Product):
			return fieldf(f("producte"), "%q is not a product id", clip(l.Product))
		case l.Quantity <= 0:
			return fieldf(f("quantitat"), "must be positive, is %d", l.Quantity)
		case l.Quantity > maxQuantity:
			return fieldf(f("quantitat"), "more than %d", maxQuantity)
		case l.PriceCents < 0:
			return fieldf(f("preu_centims"), "cannot be negative, is %d", l.PriceCents)
		case l.PriceCents > maxPriceCents:
			return fieldf(f("preu_centims"), "more than %d", maxPriceCents)
		}
	}
	if a := o.Address; a != nil {
		switch {
		case strings.TrimSpace(a.City) == "":
			return fieldf("adreca_lliurament.ciutat", "required")
		case len(a.City) > maxTextLen:
			return fieldf("adreca_lliurament.ciutat", "more than %d bytes", maxTextLen)
		case !storable(a.City):
			return fieldf("adreca_lliurament.ciutat", "contains a NUL character or invalid UTF-8")
		case !postalRE.MatchString(a.PostalCode):
			return fieldf("adreca_lliurament.codi_postal", "%q is not a 5-digit postal code", clip(a.PostalCode))
		}
	}
	return nil
}

var (
	fieldf = svc.Fieldf
	itoa   = strconv.Itoa
)

// codedf is fieldf with a codi other than svc.CodeInvalidField.
func codedf(code svc.Code, field, format string, args ...any) *svc.FieldError {
	fe := fieldf(field, format, args...)
	fe.Code = code
	return fe
}

// storable reports whether PostgreSQL accepts s as text (and as a JSONB
// string): valid UTF-8 without NUL.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
