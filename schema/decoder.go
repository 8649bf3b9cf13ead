package schema

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/km0/km0/envelope"
	"github.com/km0/km0/outcome"
)

// Upcaster turns an event of one versio into a newer one (normally the next).
// It may modify and return from, or return a copy; it must keep the tipus and
// must return a higher versio. An error is a permanent "esquema: " failure of
// the event.
type Upcaster func(from *envelope.Envelope) (*envelope.Envelope, error)

// Bump is the upcaster of a step that only added optional fields: it returns a
// copy of the event with versio + 1 and the same dades. comanda.creada v1 → v2
// is such a step: a v1 order is a v2 order whose address is absent.
func Bump(from *envelope.Envelope) (*envelope.Envelope, error) {
	c := *from
	c.Version++
	return &c, nil
}

// DecoderConfig configures a Decoder. Handles is required; the rest has
// defaults.
type DecoderConfig struct {
	// Registry holds the published schemas. Default: Default().
	Registry *Registry
	// Handles maps each tipus the handler handles to the versio it is written
	// against: the newest it knows. An event of a newer versio is a permanent
	// VersionError ("esquema: versio N not supported"); an older one is
	// validated against its own schema and upcast. A tipus not listed passes
	// through decoded but unvalidated, for the consumer to ignore.
	Handles map[string]int
	// Upcasters, keyed by (tipus, versio they start from). A chain must lead
	// from every accepted older versio to the Handles versio; a missing step
	// is a permanent UpcastError when such an event arrives.
	Upcasters map[Key]Upcaster
	// MinVersion is, per tipus, the oldest versio the handler accepts at all
	// (default 1). Older events are a permanent VersionError. Use it when an
	// old versio lacks something the handler cannot do without.
	MinVersion map[string]int
	// Require is, per tipus, an extra JSON Schema (draft 2020-12) that this
	// consumer needs the (upcast) dades to satisfy beyond the published
	// schema, e.g. `{"required": ["adreca_lliurament"]}` for repartiment. A
	// failure is a permanent ValidationError with Context RequireContext.
	// Require applies even with SkipValidation.
	Require map[string]string
	// MaxBytes is the envelope size limit. Default envelope.DefaultMaxBytes.
	MaxBytes int
	// SkipValidation turns off validation against the published schemas
	// (versions are still checked and upcast). Default false: validate.
	SkipValidation bool
}

// RequireContext is the ValidationError.Context of a DecoderConfig.Require
// failure.
const RequireContext = "consumer's requirement"

// Decoder decodes, validates and upcasts envelopes for one handler. Build it
// with NewDecoder; it is immutable and safe for concurrent use.
type Decoder struct {
	env   envelope.Decoder
	skip  bool
	types map[string]*handled
}

type handled struct {
	target, min int
	schemas     map[int]compiled // accepted versions present in the registry
	up          map[int]Upcaster
	require     *compiled
}

// ErrConfig is wrapped by every NewDecoder and DualPublish configuration error.
var ErrConfig = errors.New("schema: invalid configuration")

// NewDecoder checks cfg and returns a Decoder. It fails (wrapping ErrConfig)
// when Handles is empty, when the registry has no schema for a Handles
// versio, when an upcaster or a MinVersion names a tipus or versio outside
// what Handles accepts, or when a Require schema does not compile.
func NewDecoder(cfg DecoderConfig) (*Decoder, error) {
	reg := cfg.Registry
	if reg == nil {
		var err error
		if reg, err = Default(); err != nil {
			return nil, err
		}
	}
	if len(cfg.Handles) == 0 {
		return nil, fmt.Errorf("%w: Handles is empty", ErrConfig)
	}
	d := &Decoder{env: envelope.Decoder{MaxBytes: cfg.MaxBytes}, skip: cfg.SkipValidation, types: map[string]*handled{}}
	for tipus, target := range cfg.Handles {
		if !reg.Has(tipus, target) {
			return nil, fmt.Errorf("%w: Handles %s: no schema registered", ErrConfig, Key{tipus, target})
		}
		h := &handled{target: target, min: max(cfg.MinVersion[tipus], 1), schemas: map[int]compiled{}, up: map[int]Upcaster{}}
		if h.min > target {
			return nil, fmt.Errorf("%w: MinVersion %d of %s is above its Handles versio %d", ErrConfig, h.min, tipus, target)
		}
		for v := h.min; v <= target; v++ {
			if s, ok := reg.schemas[Key{tipus, v}]; ok {
				h.schemas[v] = s
			}
		}
		if src, ok := cfg.Require[tipus]; ok {
			s, err := compileRequirement(tipus, src)
			if err != nil {
				return nil, err
			}
			h.require = &compiled{lib: s, fast: compileFast([]byte(src))}
		}
		d.types[tipus] = h
	}
	for k, up := range cfg.Upcasters {
		h, ok := d.types[k.Type]
		if !ok || up == nil || k.Version < h.min || k.Version >= h.target {
			return nil, fmt.Errorf("%w: upcaster from %s is outside the accepted versions", ErrConfig, k)
		}
		h.up[k.Version] = up
	}
	for tipus := range cfg.MinVersion {
		if _, ok := d.types[tipus]; !ok {
			return nil, fmt.Errorf("%w: MinVersion for %s, which Handles does not list", ErrConfig, tipus)
		}
	}
	for tipus := range cfg.Require {
		if _, ok := d.types[tipus]; !ok {
			return nil, fmt.Errorf("%w: Require for %s, which Handles does not list", ErrConfig, tipus)
		}
	}
	return d, nil
}

func compileRequirement(tipus, src string) (*jsonschema.Schema, error) {
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader([]byte(src)))
	if err != nil {
		return nil, fmt.Errorf("%w: Require %s: invalid JSON: %v", ErrConfig, tipus, err)
	}
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	u := "https://km0.invalid/requisits/" + tipus + ".json"
	if err := c.AddResource(u, doc); err != nil {
		return nil, fmt.Errorf("%w: Require %s: %v", ErrConfig, tipus, err)
	}
	s, err := c.Compile(u)
	if err != nil {
		return nil, fmt.Errorf("%w: Require %s: %v", ErrConfig, tipus, err)
	}
	return s, nil
}

// Decode decodes one envelope and, for a tipus the decoder handles, checks
// its versio, validates its dades against the published schema, upcasts it
// to the handler's versio and applies the consumer's own requirement. Its
// signature is the consumer's Decode hook.
//
// Every failure is permanent (outcome.IsPermanent) and its text starts with
// "envelope: " (malformed envelope) or "esquema: " (contract). The one
// exception is an event of a newer versio that is one copy of a
// dual-published pair whose other copy this handler accepts (see
// DualPublish): Decode returns an error matching ErrIgnored and no outcome,
// and the consumer must skip it as it skips a tipus it does not handle.
func (d *Decoder) Decode(b []byte) (*envelope.Envelope, error) {
	env, err := d.env.Decode(b)
	if err != nil {
		return nil, err
	}
	h, ok := d.types[env.Type]
	if !ok {
		return env, nil
	}
	key := Key{env.Type, env.Version}
	if env.Version > h.target || env.Version < h.min {
		if env.Version > h.target && h.acceptsSibling(env) {
			return nil, &IgnoredError{Key: key, Target: h.target}
		}
		return nil, outcome.Permanent(&VersionError{Key: key, Min: h.min, Max: h.target})
	}
	if !d.skip {
		c, ok := h.schemas[env.Version]
		if !ok {
			return nil, outcome.Permanent(&UnknownError{Key: key})
		}
		if err := c.validate(key, "", env.Data); err != nil {
			return nil, outcome.Permanent(err)
		}
	}
	if env.Version < h.target {
		if env, err = h.upcast(env); err != nil {
			return nil, outcome.Permanent(err)
		}
		key = Key{env.Type, env.Version}
		if !d.skip {
			// A buggy upcaster must not hand the handler a shape it does not know.
			if err := h.schemas[h.target].validate(key, "upcast", env.Data); err != nil {
				return nil, outcome.Permanent(err)
			}
		}
	}
	if h.require != nil {
		if err := h.require.validate(key, RequireContext, env.Data); err != nil {
			return nil, outcome.Permanent(err)
		}
	}
	return env, nil
}

func (h *handled) upcast(env *envelope.Envelope) (*envelope.Envelope, error) {
	tipus := env.Type
	for env.Version < h.target {
		from := Key{tipus, env.Version}
		up, ok := h.up[env.Version]
		if !ok {
			return nil, &UpcastError{Key: from, Target: h.target, Reason: fmt.Sprintf("no upcaster from v%d", env.Version)}
		}
		out, err := up(env)
		if err != nil {
			return nil, &UpcastError{Key: from, Target: h.target, Reason: "upcaster failed", Err: err}
		}
		if out == nil || out.Type != tipus || out.Version <= from.Version || out.Version > h.target {
			return nil, &UpcastError{Key: from, Target: h.target, Reason: "upcaster returned a wrong tipus or versio"}
		}
		env = out
	}
	return env, nil
}
