package schema

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"

	"github.com/google/uuid"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
)

// Envelope members written by DualPublish, in Envelope.Extra.
const (
	// FieldCorrelation holds the outbox row id shared by every copy of a
	// dual-published event. The relay copies it to the `correlacio` header;
	// a consumer uses it, when present, as the idempotency key, so the pair
	// is handled once (IdempotencyKey).
	FieldCorrelation = "correlacio"
	// FieldPairVersions lists the versio of every copy of the pair, e.g.
	// [2,1], so a consumer that gets a copy newer than it knows can tell
	// whether it will also get one it knows (ErrIgnored) or none (DLQ).
	FieldPairVersions = "versions_publicades"
)

// Dual configures dual publishing of one tipus during a producer transition:
// rows written with Version are published as they are and, in addition,
// converted to Also.
type Dual struct {
	Type    string   // tipus, e.g. "comanda.creada"
	Version int      // the versio the producer writes to the outbox, e.g. 2
	Also    int      // the other versio published alongside, e.g. 1
	Convert Upcaster // turns the Version copy into the Also copy, e.g. DropFields(1, "adreca_lliurament")
}

// DualPublish returns the relay's Transform hook. For a row whose (tipus,
// versio) has Dual rules it returns the row's envelope followed by one
// converted copy per rule, all carrying Extra[FieldCorrelation] = row id and
// Extra[FieldPairVersions]; every other row is returned unchanged, alone.
//
// The first copy keeps id_esdeveniment = row id. Each converted copy gets a
// UUIDv5 derived from the row id and its versio, so a republication of the
// row (relay crash before marking) carries the same ids again. Each converted
// copy is validated against the registry (default Default()): no invalid
// event reaches the broker. A failing conversion or validation is returned as
// a permanent error (outcome.IsPermanent): the row cannot be published until
// the converter is fixed.
//
// DualPublish fails (wrapping ErrConfig) for a rule without Convert, with
// Also equal to Version, or naming a (tipus, versio) the registry lacks.
func DualPublish(reg *Registry, rules ...Dual) (func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error), error) {
	if reg == nil {
		var err error
		if reg, err = Default(); err != nil {
			return nil, err
		}
	}
	byKey := map[Key][]Dual{}
	for _, r := range rules {
		switch {
		case r.Convert == nil:
			return nil, fmt.Errorf("%w: dual %s: Convert is nil", ErrConfig, Key{r.Type, r.Version})
		case r.Also == r.Version:
			return nil, fmt.Errorf("%w: dual %s: Also equals Version", ErrConfig, Key{r.Type, r.Version})
		case !reg.Has(r.Type, r.Version):
			return nil, fmt.Errorf("%w: dual: no schema for %s", ErrConfig, Key{r.Type, r.Version})
		case !reg.Has(r.Type, r.Also):
			return nil, fmt.Errorf("%w: dual: no schema for %s", ErrConfig, Key{r.Type, r.Also})
		}
		k := Key{r.Type, r.Version}
		byKey[k] = append(byKey[k], r)
	}
	return func(row *outbox.Row, env *envelope.Envelope) ([]*envelope.Envelope, error) {
		rs := byKey[Key{env.Type, env.Version}]
		if len(rs) == 0 {
			return []*envelope.Envelope{env}, nil
		}
		corr, _ := json.Marshal(row.ID.String())
		versions := []int{env.Version}
		for _, r := range rs {
			versions = append(versions, r.Also)
		}
		pair, _ := json.Marshal(versions)
		out := make([]*envelope.Envelope, 0, 1+len(rs))
		out = append(out, withPair(env, corr, pair))
		for _, r := range rs {
			c, err := r.Convert(clone(env))
			if err != nil {
				return nil, outcome.Permanent(fmt.Errorf("schema: dual %s → v%d: %w", Key{env.Type, env.Version}, r.Also, err))
			}
			if c == nil || c.Type != env.Type || c.Version != r.Also {
				return nil, outcome.Permanent(fmt.Errorf("schema: dual %s → v%d: converter returned a wrong tipus or versio", Key{env.Type, env.Version}, r.Also))
			}
			if err := reg.Validate(c.Type, c.Version, c.Data); err != nil {
				return nil, outcome.Permanent(fmt.Errorf("schema: dual copy: %w", err))
			}
			c = withPair(c, corr, pair)
			c.ID = uuid.NewSHA1(row.ID, []byte("km0/dual/v"+strconv.Itoa(r.Also))).String()
			out = append(out, c)
		}
		return out, nil
	}, nil
}

func clone(e *envelope.Envelope) *envelope.Envelope {
	c := *e
	c.Extra = maps.Clone(e.Extra)
	return &c
}

func withPair(e *envelope.Envelope, corr, pair []byte) *envelope.Envelope {
	c := clone(e)
	if c.Extra == nil {
		c.Extra = map[string]json.RawMessage{}
	}
	c.Extra[FieldCorrelation] = corr
	c.Extra[FieldPairVersions] = pair
	return c
}

// DropFields returns a converter (for Dual.Convert, or an Upcaster) that sets
// the versio to `to` and removes the named top-level fields from dades, e.g.
// DropFields(1, "adreca_lliurament") for comanda.creada v2 → v1. Dades that is
// not a JSON object is an error.
func DropFields(to int, fields ...string) Upcaster {
	return func(from *envelope.Envelope) (*envelope.Envelope, error) {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(from.Data, &m); err != nil || m == nil {
			return nil, errors.New("dades is not a JSON object")
		}
		for _, f := range fields {
			delete(m, f)
		}
		data, err := json.Marshal(m)
		if err != nil {
			return nil, err
		}
		c := *from
		c.Version = to
		c.Data = data
		return &c, nil
	}
}

// IdempotencyKey returns the key a consumer records for env: its correlacio
// (FieldCorrelation) when it is one copy of a dual-published pair, so the
// pair is handled once, and otherwise its id_esdeveniment (also when the
// correlacio could not be stored as a key: envelope.CheckKey).
func IdempotencyKey(env *envelope.Envelope) string {
	return contract.IdempotencyKey(env.ID, env.Extra[FieldCorrelation])
}

// ErrIgnored is matched (errors.Is) by the error Decode returns for a copy of
// a dual-published pair that is newer than the handler knows while another
// copy of the pair is one it accepts. It carries no outcome: the consumer
// skips (counts and acknowledges) the message, as for a tipus it does not
// handle, and handles the other copy.
var ErrIgnored = errors.New("schema: newer copy of a dual-published pair, ignored")

// IgnoredError is the error behind ErrIgnored.
type IgnoredError struct {
	Key    Key // the copy's tipus and versio
	Target int // the versio the handler knows
}

func (e *IgnoredError) Error() string {
	return fmt.Sprintf("schema: %s ignored: a copy in v%d or older is published alongside", e.Key, e.Target)
}

// Is makes errors.Is(err, ErrIgnored) true,
// and errors.Is(err, outcome.ErrIgnore), which the consumer skips.
func (e *IgnoredError) Is(target error) bool {
	return target == ErrIgnored || target == outcome.ErrIgnore
}

// acceptsSibling reports whether env is one copy of a dual-published pair
// with another copy in a versio this handler accepts.
func (h *handled) acceptsSibling(env *envelope.Envelope) bool {
	raw, ok := env.Extra[FieldPairVersions]
	if !ok {
		return false
	}
	var vs []int
	if json.Unmarshal(raw, &vs) != nil {
		return false
	}
	for _, v := range vs {
		if v >= h.min && v <= h.target && v != env.Version {
			return true
		}
	}
	return false
}
