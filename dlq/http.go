package dlq

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/km0/km0/internal/pgerr"
	"github.com/km0/km0/internal/strictjson"
)

// HandlerConfig configures the admin API.
type HandlerConfig struct {
	// Token is the bearer token every endpoint requires ("Authorization:
	// Bearer <token>", checked by a Gate). Empty: every endpoint answers 403,
	// whoever asks: letters are customer data.
	Token string
	// Gate checks the token and throttles attempts; share the console's
	// when both are on one listener, so that they have one budget. Default
	// NewGate(Token, GateConfig{Now: Now}); when set, Token is ignored.
	Gate *Gate
	// SyncOnRead syncs the index before each GET. Default false: a running
	// Indexer keeps it current. POSTs always sync first.
	SyncOnRead bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Now is the clock for relative times ("36h"). Default time.Now.
	Now func() time.Time
}

// MaxListLimit is the most rows GET /letters returns at once; the groups
// always count every letter.
const MaxListLimit = 1000

// maxBody bounds a POST body.
const maxBody = 1 << 20

// Handler returns the HTTP admin API of src:
//
//	GET  /letters?topic=&motiu=&since=&until=&estat=&id=&limit=   groups and rows
//	GET  /letters/{id...}                                          one letter with its value
//	POST /replay  {"ids":[],"topic":"","motiu":"","since":"","until":"","all":false,"dry_run":false,"force":false,"retention":"336h"}
//	POST /purge   {"ids":[],"topic":"","motiu":"","since":"","until":"","all":false,"yes":true,"delete_records":false}
//
// A POST body is decoded strictly (see decodeAction): exact member names,
// no duplicates, no null, no unknown member. It must select letters: ids or
// at least one filter, or "all": true (and then nothing else) for every
// letter; an empty selection is a 400, never "everything".
//
// Every endpoint needs the bearer token, checked before anything of the
// request is validated: 401 without it or with a wrong one whatever the
// rest of the request, 429 (with Retry-After) when the Gate throttles the
// source, 403 when no token is configured. estat defaults to pendent (estat=totes for
// all); limit defaults to 100 and is at most MaxListLimit. Errors are JSON {"error": "..."}: 400 for bad
// input, 404 for an unknown letter, 409 for an unconfirmed purge, 503 when
// the index or the broker fails (a generic message; the error is logged).
func Handler(src Source, cfg HandlerConfig) http.Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Gate == nil {
		cfg.Gate = NewGate(cfg.Token, GateConfig{Now: cfg.Now})
	}
	h := &handler{src: src, cfg: cfg}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /letters", h.guard(h.list))
	mux.HandleFunc("GET /letters/{id...}", h.guard(h.show))
	mux.HandleFunc("POST /replay", h.guard(h.synced(h.replay)))
	mux.HandleFunc("POST /purge", h.guard(h.synced(h.purge)))
	return mux
}

type handler struct {
	src Source
	cfg HandlerConfig
}

// errBadRequest marks input errors (400).
var errBadRequest = errors.New("bad request")

// noTokenMessage is the answer of the admin API when no token is
// configured.
const noTokenMessage = "the dead-letter admin API is disabled: no admin token is configured " +
	"(km0 reads it from $KM0_DLQ_ADMIN_TOKEN); letters are customer data"

// guard runs next only for the right bearer token (h.cfg.Gate), before
// anything else of the request is read.
func (h *handler) guard(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		scheme, got, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		if !strings.EqualFold(scheme, "Bearer") { // scheme names are case-insensitive (RFC 9110 11.1)
			got = ""
		}
		switch v, wait := h.cfg.Gate.Check(r, got); v {
		case Granted:
			next(w, r)
		case Disabled:
			writeError(w, http.StatusForbidden, noTokenMessage)
		case Throttled:
			w.Header().Set("Retry-After", strconv.Itoa(int(wait.Seconds())+1))
			writeError(w, http.StatusTooManyRequests, "too many token attempts from this address: try again later")
		default:
			h.cfg.Logger.Warn("dlq: admin API: missing or wrong bearer token", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr)
			w.Header().Set("WWW-Authenticate", `Bearer realm="km0 dlq"`)
			writeError(w, http.StatusUnauthorized, "missing or wrong bearer token")
		}
	}
}

// synced syncs the index before next (the POSTs act on a current index).
func (h *handler) synced(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if _, err := h.src.Sync(r.Context()); err != nil {
			h.fail(w, r, err)
			return
		}
		next(w, r)
	}
}

// listParams are the query parameters of GET /letters; any other is a 400,
// so that a misspelt filter never lists letters it did not select.
var listParams = map[string]bool{"topic": true, "motiu": true, "since": true, "until": true,
	"estat": true, "id": true, "limit": true}

func (h *handler) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if !listParams[k] {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("unknown parameter %q (topic, motiu, since, until, estat, id, limit)", k))
			return
		}
	}
	f, err := filterOf(q.Get("topic"), q.Get("motiu"), q.Get("since"), q.Get("until"), q["id"], h.cfg.Now())
	if err == nil {
		f.States, err = ParseState(cmp.Or(q.Get("estat"), string(StatePending)))
	}
	if err == nil {
		f.Limit, err = limitOf(q.Get("limit"))
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if h.cfg.SyncOnRead {
		if _, err := h.src.Sync(r.Context()); err != nil {
			h.fail(w, r, err)
			return
		}
	}
	ls, err := h.src.List(r.Context(), f)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, ListingView(ls))
}

// ListingView is the JSON form of a Listing.
func ListingView(ls *Listing) any {
	rows := make([]LetterView, len(ls.Letters))
	for i, l := range ls.Letters {
		rows[i] = View(l, false)
	}
	groups := ls.Groups
	if groups == nil {
		groups = []Group{}
	}
	return struct {
		Groups  []Group      `json:"grups"`
		Letters []LetterView `json:"cartes"`
		// Refused: letters the index set aside (Store.Refused).
		Refused int `json:"refusades"`
	}{groups, rows, ls.Refused}
}

func (h *handler) show(w http.ResponseWriter, r *http.Request) {
	if h.cfg.SyncOnRead {
		if _, err := h.src.Sync(r.Context()); err != nil {
			h.fail(w, r, err)
			return
		}
	}
	id := r.PathValue("id")
	if err := checkText("id", id); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	l, err := h.src.Get(r.Context(), id)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, View(l, true))
}

// actionRequest is the body of POST /replay and POST /purge.
type actionRequest struct {
	IDs           []string `json:"ids"`
	Topic         string   `json:"topic"`
	Reason        string   `json:"motiu"`
	Since         string   `json:"since"`
	Until         string   `json:"until"`
	DryRun        bool     `json:"dry_run"`
	Force         bool     `json:"force"`
	Retention     string   `json:"retention"`
	Yes           bool     `json:"yes"`
	DeleteRecords bool     `json:"delete_records"`
	All           bool     `json:"all"`
}

// errEmptySelection is the answer to a replay or purge that selects nothing
// and does not say "all": true.
const errEmptySelection = `empty selection: give "ids" or a filter (topic, motiu, since, until), or "all": true to select every letter`

func (h *handler) decode(w http.ResponseWriter, r *http.Request) (*actionRequest, Filter, bool) {
	req, err := decodeAction(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		writeError(w, http.StatusBadRequest, "body: "+err.Error())
		return nil, Filter{}, false
	}
	f, err := filterOf(req.Topic, req.Reason, req.Since, req.Until, req.IDs, h.cfg.Now())
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return nil, Filter{}, false
	}
	switch {
	case f.Empty() && !req.All:
		writeError(w, http.StatusBadRequest, errEmptySelection)
		return nil, Filter{}, false
	case !f.Empty() && req.All:
		writeError(w, http.StatusBadRequest, `"all": true selects every letter: send it without ids or filters`)
		return nil, Filter{}, false
	}
	return req, f, true
}

// decodeAction reads a POST body strictly (internal/strictjson): exactly one
// JSON object, member names in their exact case, each at most once, only the
// members of actionRequest, no null (neither the body nor a member), nothing
// after the object. A body the handler would read differently from its
// sender is refused rather than guessed at.
func decodeAction(r io.Reader) (*actionRequest, error) {
	body, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	var req actionRequest
	if err := (strictjson.Options{DisallowUnknownFields: true}).Unmarshal(body, &req); err != nil {
		return nil, err
	}
	var members map[string]json.RawMessage
	if err := json.Unmarshal(body, &members); err != nil || members == nil {
		return nil, errors.New("want a JSON object")
	}
	for k, v := range members {
		if string(v) == "null" {
			return nil, fmt.Errorf("%s: null is not a value here; leave the member out", k)
		}
	}
	return &req, nil
}

func (h *handler) replay(w http.ResponseWriter, r *http.Request) {
	req, f, ok := h.decode(w, r)
	if !ok {
		return
	}
	o := ReplayOptions{DryRun: req.DryRun, Force: req.Force}
	if req.Retention != "" {
		d, err := time.ParseDuration(req.Retention)
		if err != nil || d <= 0 {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("retention %q: want a positive duration such as 336h", req.Retention))
			return
		}
		o.Retention = d
	}
	rep, err := h.src.Replay(r.Context(), f, o)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

func (h *handler) purge(w http.ResponseWriter, r *http.Request) {
	req, f, ok := h.decode(w, r)
	if !ok {
		return
	}
	rep, err := h.src.Purge(r.Context(), f, PurgeOptions{Confirmed: req.Yes, DeleteRecords: req.DeleteRecords})
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

// fail answers err without internals: a remote caller never sees SQL text,
// hosts, users or database names; the full error is logged. Bad input (a
// value the index cannot compare, such as a NUL byte) is a 400; any other
// failure of the index or the broker is a 503.
func (h *handler) fail(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, ErrNotFound):
		writeError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, ErrNotConfirmed):
		writeError(w, http.StatusConflict, `purge not confirmed: send "yes": true`)
	case errors.Is(err, errBadRequest):
		writeError(w, http.StatusBadRequest, err.Error())
	case pgerr.DataException(err):
		h.cfg.Logger.Warn("dlq: admin API: bad input", "method", r.Method, "path", r.URL.Path, "err", err)
		writeError(w, http.StatusBadRequest, "bad input: a value the index cannot store or compare")
	default:
		h.cfg.Logger.Error("dlq: admin API", "method", r.Method, "path", r.URL.Path, "err", err)
		writeError(w, http.StatusServiceUnavailable, "the dead-letter index is unavailable; the server log has the details")
	}
}

// checkText refuses text the index cannot hold (PostgreSQL TEXT takes
// neither NUL nor invalid UTF-8); such a filter could match no letter.
func checkText(name, v string) error {
	if strings.ContainsRune(v, 0) || !utf8.ValidString(v) {
		return fmt.Errorf("%w: %s: a NUL byte or invalid UTF-8 cannot match any letter", errBadRequest, name)
	}
	return nil
}

// filterOf builds a Filter from textual input; errors wrap errBadRequest.
func filterOf(topic, reason, since, until string, ids []string, now time.Time) (Filter, error) {
	f := Filter{Topic: topic, Reason: reason, IDs: ids}
	for _, c := range [][2]string{{"topic", topic}, {"motiu", reason}} {
		if err := checkText(c[0], c[1]); err != nil {
			return f, err
		}
	}
	for _, id := range ids {
		if err := checkText("id", id); err != nil {
			return f, err
		}
	}
	var err error
	if f.Since, err = ParseTime(since, now); err != nil {
		return f, fmt.Errorf("%w: since: %w", errBadRequest, err)
	}
	if f.Until, err = ParseTime(until, now); err != nil {
		return f, fmt.Errorf("%w: until: %w", errBadRequest, err)
	}
	return f, nil
}

func limitOf(s string) (int, error) {
	if s == "" {
		return 100, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > MaxListLimit {
		return 0, fmt.Errorf("limit %q: want a number from 1 to %d (the groups count every letter)", s, MaxListLimit)
	}
	return n, nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}
