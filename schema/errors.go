package schema

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/santhosh-tekuri/jsonschema/v6/kind"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// Problem is one reason a document does not match its schema.
type Problem struct {
	Path    string // JSON pointer of the offending field, e.g. "/linies/0/quantitat"; "/" for the whole document
	Message string // what is wrong, e.g. "must be >= 1 (got 0)"
}

func (p Problem) String() string { return p.Path + ": " + p.Message }

// MaxProblemsShown is how many problems ValidationError.Error lists before
// summarising the rest as "(+N more)".
const MaxProblemsShown = 3

// ValidationError says dades does not match the schema of Key. Its message
// starts with "esquema: ", names the schema and each offending field:
//
//	esquema: comanda.creada v2: /linies/0/quantitat: must be >= 1 (got 0)
type ValidationError struct {
	Key Key
	// Context is "" for the published schema, or the name of a consumer's
	// own requirement (DecoderConfig.Require): RequireContext.
	Context  string
	Problems []Problem // sorted by path; never empty; at most MaxProblemsKept
	// More counts the problems found beyond Problems: a hostile document
	// (a 1 MB array of empty objects) has a million, and keeping them all
	// cost a consumer 600 MB and a second of CPU to reject one message.
	More int
}

// MaxProblemsKept bounds ValidationError.Problems: the first ones by path
// (among the first 1,024 found).
const MaxProblemsKept = 64

func (e *ValidationError) Error() string {
	var b strings.Builder
	b.WriteString("esquema: ")
	b.WriteString(e.Key.String())
	if e.Context != "" {
		b.WriteString(" (" + e.Context + ")")
	}
	for i, p := range e.Problems {
		if i == MaxProblemsShown {
			fmt.Fprintf(&b, " (+%d more)", len(e.Problems)-i+e.More)
			break
		}
		if i == 0 {
			b.WriteString(": ")
		} else {
			b.WriteString("; ")
		}
		b.WriteString(p.String())
	}
	return b.String()
}

// Is makes errors.Is(err, ErrSchema) true.
func (e *ValidationError) Is(target error) bool { return target == ErrSchema }

var printer = message.NewPrinter(language.English)

// problems flattens the library's error tree into its leaves, one per
// offending field, sorted by path for a deterministic message.
func problems(ve *jsonschema.ValidationError) (kept []Problem, more int) {
	var out []Problem
	var walk func(e *jsonschema.ValidationError)
	walk = func(e *jsonschema.ValidationError) {
		if len(e.Causes) > 0 {
			for _, c := range e.Causes {
				walk(c)
			}
			return
		}
		if len(out) >= maxProblemsWalked { // only count: wording each one is the cost
			if k, ok := e.ErrorKind.(*kind.Required); ok {
				more += len(k.Missing)
			} else {
				more++
			}
			return
		}
		out = append(out, leaf(e)...)
	}
	walk(ve)
	if len(out) == 0 {
		out = []Problem{{Path: "/", Message: ve.Error()}}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	if len(out) > MaxProblemsKept {
		more += len(out) - MaxProblemsKept
		out = out[:MaxProblemsKept:MaxProblemsKept]
	}
	return out, more
}

// maxProblemsWalked bounds the problems worded before sorting; past it they
// are only counted. A document has that many only when it is hostile or
// badly broken, and then which 64 are shown matters little.
const maxProblemsWalked = 1024

func pointer(tokens []string) string {
	if len(tokens) == 0 {
		return "/"
	}
	var b strings.Builder
	for _, t := range tokens {
		b.WriteByte('/')
		b.WriteString(strings.ReplaceAll(strings.ReplaceAll(t, "~", "~0"), "/", "~1"))
	}
	return b.String()
}

// leaf words one failed keyword. A missing required field is reported at the
// field's own path ("/adreca_lliurament: required"), so that the path always
// names the field.
func leaf(e *jsonschema.ValidationError) []Problem {
	at := pointer(e.InstanceLocation)
	if k, ok := e.ErrorKind.(*kind.Required); ok {
		out := make([]Problem, len(k.Missing))
		for i, m := range k.Missing {
			out[i] = Problem{Path: pointer(append(slices.Clone(e.InstanceLocation), m)), Message: "required field missing"}
		}
		return out
	}
	return []Problem{describe(e, at)}
}

func describe(e *jsonschema.ValidationError, at string) Problem {
	switch k := e.ErrorKind.(type) {
	case *kind.Type:
		return Problem{Path: at, Message: fmt.Sprintf("must be %s (got %s)", strings.Join(k.Want, " or "), k.Got)}
	case *kind.Minimum:
		return Problem{Path: at, Message: fmt.Sprintf("must be >= %s (got %s)", rat(k.Want.FloatString(6)), rat(k.Got.FloatString(6)))}
	case *kind.Maximum:
		return Problem{Path: at, Message: fmt.Sprintf("must be <= %s (got %s)", rat(k.Want.FloatString(6)), rat(k.Got.FloatString(6)))}
	case *kind.MinItems:
		return Problem{Path: at, Message: fmt.Sprintf("must have at least %d item(s) (got %d)", k.Want, k.Got)}
	case *kind.MinLength:
		if k.Want == 1 {
			return Problem{Path: at, Message: "must not be empty"}
		}
		return Problem{Path: at, Message: fmt.Sprintf("must be at least %d characters (got %d)", k.Want, k.Got)}
	default:
		return Problem{Path: at, Message: e.ErrorKind.LocalizedString(printer)}
	}
}

// rat trims a decimal string's useless fraction: "1.000000" → "1".
func rat(s string) string {
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}

// VersionError says the consumer does not handle an event's versio: newer
// than any it knows, or older than the minimum it requires
// (DecoderConfig.MinVersion). The message for a newer versio is exactly
// "esquema: versio N not supported" (the DLQ motiu's code esquema, as the
// contract spells it, then English); after a consumer upgrade, km0 dlq replay
// brings the event back. For an older one it adds the minimum: "esquema:
// versio 1 not supported (minimum 2)".
type VersionError struct {
	Key Key // the event's tipus and versio
	Min int // the oldest versio the consumer accepts
	Max int // the newest versio the consumer handles
}

func (e *VersionError) Error() string {
	msg := "esquema: versio " + strconv.Itoa(e.Key.Version) + " not supported"
	if e.Key.Version < e.Min {
		msg += " (minimum " + strconv.Itoa(e.Min) + ")"
	}
	return msg
}

// Is makes errors.Is(err, ErrSchema) true.
func (e *VersionError) Is(target error) bool { return target == ErrSchema }

// UpcastError says an older event could not be brought to the version the
// handler knows: no upcaster for a step, a failing upcaster, or one that did
// not advance the versio.
type UpcastError struct {
	Key    Key // the event's tipus and versio before the failed step
	Target int // the versio the handler knows
	Reason string
	Err    error // the upcaster's error, if any
}

func (e *UpcastError) Error() string {
	msg := fmt.Sprintf("esquema: %s: cannot upcast to v%d: %s", e.Key, e.Target, e.Reason)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns the upcaster's error.
func (e *UpcastError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrSchema) true.
func (e *UpcastError) Is(target error) bool { return target == ErrSchema }
