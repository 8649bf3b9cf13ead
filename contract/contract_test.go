package contract_test

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/contract"
)

// One encoding: FormatTime writes unix seconds with six decimals, and
// ParseTime gives back the same microsecond, for times across the range a
// header can carry.
func TestTimeRoundTripsToTheMicrosecond(t *testing.T) {
	t.Parallel()
	for _, tm := range []time.Time{
		time.Unix(1789000000, 250_000_000),
		time.Unix(1789000000, 123_456_000),
		time.Unix(1789000000, 999_999_000),
		time.Unix(1, 0),
		time.Unix(99_999_999_999, 1000), // the last second read as seconds
		time.Now().Truncate(time.Microsecond),
	} {
		s := contract.FormatTime(tm)
		if i := strings.IndexByte(s, '.'); i < 0 || len(s)-i-1 != 6 {
			t.Errorf("FormatTime(%v) = %q, want six decimals", tm, s)
		}
		got, err := contract.ParseTime(s)
		if err != nil || !got.Equal(tm) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v", s, got, err, tm)
		}
	}
	if got := contract.FormatTime(time.Unix(1789000000, 5_000)); got != "1789000000.000005" {
		t.Errorf("FormatTime = %q", got)
	}
}

// Readers take every decimal form a writer of the contract may use,
// including the unix milliseconds RabbitMQ copies carried before the time
// headers were unified (an integer above 1e11), so a copy still queued from
// then keeps its times.
func TestParseTimeAcceptsSecondsAndLegacyMilliseconds(t *testing.T) {
	t.Parallel()
	cases := map[string]time.Time{
		"1789000000":         time.Unix(1789000000, 0),
		" 1789000000.25 ":    time.Unix(1789000000, 250_000_000),
		"1789000000.2501234": time.Unix(1789000000, 250_123_000), // a Python float, to the microsecond
		"1.78900000025e9":    time.Unix(1789000000, 250_000_000),
		"1789000000123":      time.UnixMilli(1789000000123), // RabbitMQ's old primera_fallada / mort_en
		"1789000000123.5":    time.UnixMilli(1789000000123).Add(500 * time.Microsecond),
		"100000000000":       time.Unix(100000000000, 0),     // 1e11 exactly: still seconds
		"100000000001":       time.UnixMilli(100000000001),   // above it: milliseconds
		"99999999999999":     time.UnixMilli(99999999999999), // the last millisecond accepted
	}
	for in, want := range cases {
		got, err := contract.ParseTime(in)
		if err != nil || !got.Equal(want) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "abc", "NaN", "Inf", "-Inf", "+Inf", "1e400", "0", "-5", "1e300", "1e15", "100000000000001", "99999999999999999.0", "0.0", "1.2.3",
		"2026-03-01T10:00:00Z", "0x10"} {
		if got, err := contract.ParseTime(bad); !errors.Is(err, contract.ErrNotTime) {
			t.Errorf("ParseTime(%q) = %v, %v; want ErrNotTime", bad, got, err)
		}
	}
}

// A consumer holds a retry copy no longer than its own maximum backoff,
// whatever its no_abans says: the year 2100, a number too large to be a
// time (it once overflowed into the past) or anything between. A value that
// is no number is no wait.
func TestNotBeforeIsClampedToTheMaximumBackoff(t *testing.T) {
	t.Parallel()
	now := time.Unix(1789000000, 0)
	const maxWait = time.Hour
	limit := now.Add(maxWait)
	soon := now.Add(10 * time.Minute)
	cases := map[string]time.Time{
		contract.FormatTime(soon):                  soon,
		contract.FormatTime(now.Add(-time.Minute)): now.Add(-time.Minute), // due: released at once
		contract.FormatTime(limit):                 limit,
		"4102444800":                               limit, // 2100-01-01
		"4102444800000":                            limit, // the same, in milliseconds
		"1e300":                                    limit,
		strconv.FormatFloat(math.MaxFloat64, 'f', -1, 64): limit,
		"NaN":   {},
		"Inf":   {},
		"-Inf":  {},
		"1e400": {}, // not a float64: as unreadable as "abc"
		"abc":   {},
		"":      {},
		"-7":    {},
		"0":     {},
	}
	for in, want := range cases {
		if got := contract.NotBefore(in, now, maxWait); !got.Equal(want) {
			t.Errorf("NotBefore(%q) = %v, want %v", in, got, want)
		}
	}
	if got := contract.NotBefore("4102444800", now, 0); !got.Equal(now) {
		t.Errorf("NotBefore with no wait allowed = %v, want now", got)
	}
}

// intents is trusted no further than the configuration: below 1 or not an
// integer it counts as 1, and however large it is it makes the copy's
// attempt the last one (a failure dead-letters it) without overflowing.
func TestAttemptIsClampedToTheConfiguredAttempts(t *testing.T) {
	t.Parallel()
	cases := []struct {
		intents string
		max     int
		want    int
	}{
		{"1", 3, 2}, {"2", 3, 3}, {" 1 ", 3, 2},
		{"-7", 3, 2}, {"0", 3, 2}, {"", 3, 2}, {"abc", 3, 2}, {"2.0", 3, 2},
		{"3", 3, 3}, {"1000000", 3, 3}, {"9223372036854775807", 3, 3}, {"99999999999999999999999", 3, 3},
		{"-99999999999999999999999", 3, 2},
		{"1", 1, 2}, {"5", 10, 6}, {"50", 10, 10},
	}
	for _, c := range cases {
		if got := contract.Attempt(c.intents, c.max); got != c.want {
			t.Errorf("Attempt(%q, %d) = %d, want %d", c.intents, c.max, got, c.want)
		}
	}
}

// The tipus header is filtered on only when it is unambiguous, and a header
// that disagrees with the envelope is an error that names both.
func TestTypeHeaderFilterAndCheck(t *testing.T) {
	t.Parallel()
	th := func(vals ...string) *contract.TypeHeader {
		var h contract.TypeHeader
		for _, v := range vals {
			h.Add(v)
		}
		return &h
	}
	for _, c := range []struct {
		vals     []string
		filter   string
		usable   bool
		envType  string
		mismatch string // "" when Check passes
		notText  string // added with AddNotText after vals
	}{
		{nil, "", false, "comanda.creada", "", ""},
		{[]string{"comanda.creada"}, "comanda.creada", true, "comanda.creada", "", ""},
		{[]string{"comanda.creada", "comanda.creada"}, "comanda.creada", true, "comanda.creada", "", ""},
		{[]string{"comanda.creada"}, "comanda.creada", true, "comanda.pagada",
			`esquema: header tipus "comanda.creada" does not match the envelope's "comanda.pagada"`, ""},
		{[]string{"comanda.pagada", "comanda.creada"}, "", false, "comanda.creada",
			`esquema: header tipus ambiguous: "comanda.pagada" and "comanda.creada" does not match the envelope's "comanda.creada"`, ""},
		{[]string{"comanda\xff.creada"}, "", false, "comanda.creada",
			`esquema: header tipus not UTF-8 "comanda\xff.creada" does not match the envelope's "comanda.creada"`, ""},
		{[]string{""}, "", false, "comanda.creada", `esquema: header tipus "" does not match the envelope's "comanda.creada"`, ""},
		{nil, "", false, "comanda.creada",
			`esquema: header tipus not text "5 (int32)" does not match the envelope's "comanda.creada"`, "5 (int32)"},
		{[]string{"comanda.creada"}, "", false, "comanda.creada",
			`esquema: header tipus ambiguous: "comanda.creada" and "5 (int32)" does not match the envelope's "comanda.creada"`, "5 (int32)"},
		{[]string{strings.Repeat("x", 100)}, strings.Repeat("x", 100), true, "comanda.creada",
			`esquema: header tipus "` + strings.Repeat("x", 40) + `"… does not match the envelope's "comanda.creada"`, ""},
	} {
		h := th(c.vals...)
		if c.notText != "" {
			h.AddNotText(c.notText)
		}
		if f, ok := h.Filter(); ok != c.usable || (ok && f != c.filter) {
			t.Errorf("%q: Filter() = %q, %v; want %q, %v", c.vals, f, ok, c.filter, c.usable)
		}
		err := h.Check(c.envType)
		switch {
		case c.mismatch == "" && err != nil:
			t.Errorf("%q vs %q: %v", c.vals, c.envType, err)
		case c.mismatch != "" && (err == nil || err.Error() != c.mismatch || !errors.Is(err, contract.ErrTypeMismatch)):
			t.Errorf("%q vs %q: %v\nwant %s", c.vals, c.envType, err, c.mismatch)
		}
	}
}
