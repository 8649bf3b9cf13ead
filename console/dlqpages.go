package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/km0/km0/contract"
	"github.com/km0/km0/dlq"
	"github.com/km0/km0/keyorder"
)

// groupRow is one failure group of the overview.
type groupRow struct {
	dlq.Group
	Sample *dlq.Letter // logged in only
}

// stateParam reads the estat parameter of the overview and a group page
// (pendent when absent; dlq.ParseState takes the English words too). It
// returns the stored word the page's links and forms carry on (pendent,
// reproduida, purgada or totes), the states it selects, and the English
// that people read (pending, replayed, purged or all).
func stateParam(v string) (estat string, states []dlq.State, showing string, err error) {
	if v == "" {
		v = string(dlq.StatePending)
	}
	states, err = dlq.ParseState(v)
	switch {
	case err != nil:
		return "", nil, "", err
	case len(states) == 0:
		return "totes", nil, "all", nil
	}
	return string(states[0]), states, states[0].English(), nil
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	estat, states, showing, err := stateParam(q.Get("estat"))
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	n, err := parseNarrowing(q.Get, c.cfg.Now())
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	loggedIn := c.auth.lookup(r) != nil
	if n.Motiu != "" && !loggedIn {
		// Reasons hold customer data: counts by a motiu prefix would let
		// anyone read them a character at a time.
		c.errorPage(w, r, http.StatusUnauthorized, "log in to filter by motiu: reasons may hold customer data")
		return
	}
	data := map[string]any{"Estat": estat, "Showing": showing, "HasDLQ": c.cfg.Source != nil, "N": n, "Pending": estat == string(dlq.StatePending)}
	if c.cfg.Source != nil {
		f := dlq.Filter{States: states, Limit: 1}
		n.apply(&f)
		ls, err := c.cfg.Source.List(r.Context(), f)
		if err != nil {
			c.cfg.Logger.Error("console: list", "err", err)
			data["DLQError"] = "the dead-letter index is unavailable; the server log has the details"
		} else {
			rows := make([]groupRow, len(ls.Groups))
			total := 0
			for i, g := range ls.Groups {
				rows[i] = groupRow{Group: g}
				total += g.Count
				if loggedIn {
					gf := dlq.Filter{Topic: g.Topic, Class: g.Class, States: states, Limit: 1}
					consumerFilter(&gf, g.Consumer)
					n.apply(&gf)
					s, err := c.cfg.Source.List(r.Context(), gf)
					if err == nil && len(s.Letters) > 0 {
						rows[i].Sample = s.Letters[0]
					}
				}
			}
			data["Groups"], data["Total"] = rows, total
		}
	}
	data["Lag"] = c.lagView(r)
	data["Health"] = c.health(r.Context())
	c.renderPage(w, r, http.StatusOK, "overview", page{Title: "Dead letters", Refresh: refreshSeconds, Data: data})
}

// narrowing is the filter form of the overview, as the CLI's selection
// flags: a topic (DLQ or original), the consumer group that dead-lettered
// the letters (consumidor; dlq.NoConsumer for none), a motiu prefix
// (--motiu), and the dead time in [Since, Until) (--since, --until, in the
// same forms). Ages are
// resolved once, when the form is read, and carried on as absolute times,
// so a dry run, its confirmation and the job select the same letters.
type narrowing struct {
	Topic        string
	Consumer     string
	Motiu        string
	Since, Until time.Time
}

// parseNarrowing reads the fields topic, consumidor, motiu, des_de and fins_a.
func parseNarrowing(get func(string) string, now time.Time) (narrowing, error) {
	var n narrowing
	var err error
	if n.Topic, err = text(strings.TrimSpace(get("topic"))); err != nil {
		return n, err
	}
	if n.Motiu, err = text(get("motiu")); err != nil {
		return n, err
	}
	if n.Consumer, err = text(strings.TrimSpace(get("consumidor"))); err != nil {
		return n, err
	}
	for _, f := range []struct {
		name string
		to   *time.Time
	}{{"des_de", &n.Since}, {"fins_a", &n.Until}} {
		v, err := text(get(f.name))
		if err != nil {
			return n, err
		}
		if *f.to, err = dlq.ParseTime(v, now); err != nil {
			return n, fmt.Errorf("%w: %s: %v", errBadInput, f.name, err)
		}
	}
	if !n.Since.IsZero() && !n.Until.IsZero() && !n.Until.After(n.Since) {
		return n, fmt.Errorf("%w: fins_a must be after des_de", errBadInput)
	}
	return n, nil
}

// consumerFilter narrows f to the letters of consumer group g (the form's
// consumidor; dlq.NoConsumer: those that name none; "": every consumer).
func consumerFilter(f *dlq.Filter, g string) {
	if g == dlq.NoConsumer {
		f.NoGroup = true
		return
	}
	f.Group = g
}

// Empty reports whether n selects every letter.
func (n narrowing) Empty() bool {
	return n.Topic == "" && n.Consumer == "" && n.Motiu == "" && n.Since.IsZero() && n.Until.IsZero()
}

// apply narrows f by n (a topic or consumer f already has wins: a group's).
func (n narrowing) apply(f *dlq.Filter) {
	if f.Topic == "" {
		f.Topic = n.Topic
	}
	if f.Group == "" && !f.NoGroup {
		consumerFilter(f, n.Consumer)
	}
	f.Reason, f.Since, f.Until = n.Motiu, n.Since, n.Until
}

// Pairs are the form fields that carry n but its topic and consumer (a
// group's link and form carry the group's own).
func (n narrowing) Pairs() []struct{ Name, Value string } {
	var out []struct{ Name, Value string }
	add := func(name, v string) {
		if v != "" {
			out = append(out, struct{ Name, Value string }{name, v})
		}
	}
	add("motiu", n.Motiu)
	add("des_de", n.SinceText())
	add("fins_a", n.UntilText())
	return out
}

// SinceText and UntilText are the bounds as the form shows them.
func (n narrowing) SinceText() string { return stampRFC3339(n.Since) }
func (n narrowing) UntilText() string { return stampRFC3339(n.Until) }

func stampRFC3339(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// Describe names n's conditions for people ("" when none).
func (n narrowing) Describe() string {
	var parts []string
	if n.Consumer != "" {
		parts = append(parts, fmt.Sprintf("consumer %q", n.Consumer))
	}
	if n.Motiu != "" {
		parts = append(parts, fmt.Sprintf("motiu starting %q", n.Motiu))
	}
	if !n.Since.IsZero() {
		parts = append(parts, "dead at or after "+n.SinceText())
	}
	if !n.Until.IsZero() {
		parts = append(parts, "dead before "+n.UntilText())
	}
	return strings.Join(parts, ", ")
}

// selection is what a replay or purge form selects: a whole failure group
// (abast=grup: topic, consumidor and classe; without consumidor, the class
// of every consumer), letters by ID (abast=seleccio), or every
// letter the overview's filter form selects (abast=filtre: never empty);
// a group and a filter are narrowed by N.
type selection struct {
	Scope string // "grup", "seleccio" or "filtre"
	Topic string
	Class string
	IDs   []string
	Force bool
	N     narrowing
}

// errNoneTicked is a selection of letters by ID with none ticked.
var errNoneTicked = fmt.Errorf("%w: no letter selected", errBadInput)

func parseSelection(r *http.Request, now time.Time) (selection, error) {
	s := selection{Scope: r.PostFormValue("abast"), Force: r.PostFormValue("force") == "1"}
	var err error
	if s.N, err = parseNarrowing(r.PostFormValue, now); err != nil {
		return s, err
	}
	s.Topic, s.N.Topic = s.N.Topic, ""
	if s.Class, err = text(r.PostFormValue("classe")); err != nil {
		return s, err
	}
	for _, id := range r.PostForm["id"] {
		if _, err := text(id); err != nil {
			return s, err
		}
	}
	switch s.Scope {
	case "grup":
		if s.Topic == "" || s.Class == "" {
			return s, fmt.Errorf("%w: a group needs its topic and class", errBadInput)
		}
	case "seleccio":
		s.IDs = r.PostForm["id"]
		if len(s.IDs) == 0 {
			return s, errNoneTicked
		}
	case "filtre":
		s.Class = ""
		if s.Topic == "" && s.N.Empty() {
			return s, fmt.Errorf("%w: a filter needs a topic, a motiu prefix or a time bound (it never selects every letter)", errBadInput)
		}
	default:
		return s, fmt.Errorf("%w: abast must be grup, seleccio or filtre", errBadInput)
	}
	return s, nil
}

// filter returns the dlq.Filter of s. It is never empty: an empty selection
// would mean every letter.
func (s selection) filter() dlq.Filter {
	if s.Scope == "seleccio" {
		return dlq.Filter{IDs: s.IDs}
	}
	f := dlq.Filter{Topic: s.Topic, Class: s.Class}
	s.N.apply(&f)
	return f
}

// Hidden returns the form fields that carry s to the next step.
func (s selection) Hidden() []struct{ Name, Value string } {
	out := []struct{ Name, Value string }{{"abast", s.Scope}, {"topic", s.Topic}, {"classe", s.Class}}
	if s.N.Consumer != "" {
		out = append(out, struct{ Name, Value string }{"consumidor", s.N.Consumer})
	}
	out = append(out, s.N.Pairs()...)
	if s.Force {
		out = append(out, struct{ Name, Value string }{"force", "1"})
	}
	for _, id := range s.IDs {
		out = append(out, struct{ Name, Value string }{"id", id})
	}
	return out
}

// Describe names s for people.
func (s selection) Describe() string {
	var d string
	switch s.Scope {
	case "seleccio":
		return fmt.Sprintf("%d selected letter(s)", len(s.IDs))
	case "grup":
		d = fmt.Sprintf("every pending letter of %s with class %q", s.Topic, s.Class)
		if s.N.Consumer != "" {
			d = fmt.Sprintf("every pending letter of %s that consumer %q dead-lettered with class %q", s.Topic, s.N.Consumer, s.Class)
			n := s.N
			n.Consumer = ""
			if nd := n.Describe(); nd != "" {
				d += " with " + nd
			}
			return d
		}
	default:
		d = "every pending letter"
		if s.Topic != "" {
			d += " of " + s.Topic
		}
	}
	if n := s.N.Describe(); n != "" {
		d += " with " + n
	}
	return d
}

func (c *Console) needSource(w http.ResponseWriter, r *http.Request) bool {
	if c.cfg.Source == nil {
		c.errorPage(w, r, http.StatusNotFound, "this console has no dead-letter index")
		return false
	}
	return true
}

func (c *Console) groupPage(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	q := r.URL.Query()
	topic, err1 := text(q.Get("topic"))
	class, err2 := text(q.Get("classe"))
	estat, states, showing, err3 := stateParam(q.Get("estat"))
	if err1 != nil || err2 != nil || err3 != nil || topic == "" || class == "" {
		c.errorPage(w, r, http.StatusBadRequest, "a group page needs topic and classe (and estat pendent, reproduida, purgada or totes)")
		return
	}
	n, err := parseNarrowing(func(k string) string {
		if k == "topic" {
			return "" // the group's own
		}
		return q.Get(k)
	}, c.cfg.Now())
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	const limit = 500
	// One row per event and consumer: duplicate letters fold into it, and
	// a row stands for all its copies (copies.go).
	f := dlq.Filter{Topic: topic, Class: class, States: states, Limit: limit, Fold: true}
	consumerFilter(&f, n.Consumer)
	n.apply(&f)
	ls, err := c.cfg.Source.List(r.Context(), f)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	count := total(ls)
	shown, folded := 0, 0 // letters in the rows shown, and copies beyond the first
	for _, l := range ls.Letters {
		shown += l.Copies
		folded += l.Copies - 1
	}
	title := topic + " · " + class
	if n.Consumer != "" {
		title = topic + " · " + n.Consumer + " · " + class
	}
	consumerOnly := n
	consumerOnly.Consumer = ""
	c.renderPage(w, r, http.StatusOK, "group", page{Title: title, Data: map[string]any{
		"Topic": topic, "Consumer": n.Consumer, "Class": class, "Estat": estat, "Showing": showing, "Count": count, "Letters": ls.Letters,
		"Shown": shown, "Folded": folded, "Pending": estat == string(dlq.StatePending), "Rabbit": c.cfg.Broker == "RabbitMQ",
		"N": n, "Rest": consumerOnly.Describe(), "NoneTicked": q.Get("avis") == "cap",
	}})
}

// header is one header of a letter, made safe to show. A time header of the
// contract (unix seconds) shows as a date, with the raw value in Raw (the
// page's hover title).
type header struct{ Key, Value, Raw string }

// timeHeaders are the contract's time headers: unix seconds, as a decimal
// string, on both brokers.
var timeHeaders = map[string]bool{
	contract.HeaderNotBefore: true, contract.HeaderFirstFailure: true, contract.HeaderOriginalTime: true,
	contract.HeaderDeadAt: true, contract.HeaderDeadline: true,
}

// showHeader is header k=v as the letter page shows it.
func showHeader(k, v string) header {
	h := header{Key: dlq.Safe(k), Value: dlq.Safe(v)}
	if timeHeaders[k] {
		if t, err := contract.ParseTime(v); err == nil {
			h.Raw, h.Value = h.Value, t.UTC().Format("2006-01-02 15:04:05.000Z")
		}
	}
	return h
}

func (c *Console) letterPage(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	id, err := text(r.URL.Query().Get("id"))
	if err != nil || id == "" {
		c.errorPage(w, r, http.StatusBadRequest, "a letter page needs id")
		return
	}
	l, err := c.cfg.Source.Get(r.Context(), id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	hs := make([]header, len(l.Headers))
	for i, h := range l.Headers {
		hs[i] = showHeader(h.Key, h.Value)
	}
	sort.SliceStable(hs, func(i, j int) bool { return hs[i].Key < hs[j].Key })
	history := l.History()
	for i := range history {
		history[i].Error = dlq.Safe(history[i].Error)
	}
	value, isJSON := dlq.PrettyValue(l.Value, 0)
	envErr := ""
	if _, err := l.Envelope(); err != nil {
		envErr = err.Error()
	}
	seqs, err := c.sequencesOf(r.Context(), l)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.renderPage(w, r, http.StatusOK, "letter", page{Title: "Letter " + l.ID, Data: map[string]any{
		"L": l, "Class": l.Class(), "Reason": dlq.Safe(l.Reason), "Headers": hs, "Value": value, "IsJSON": isJSON,
		"EnvelopeError": envErr, "Key": dlq.Safe(string(l.Key)), "Rabbit": c.cfg.Broker == "RabbitMQ",
		"Sequences": seqs, "History": history,
	}})
}

// seqView is a blocked key's sequence as the letter page shows it.
type seqView struct {
	Service                          string // its ServiceDB's name
	Consumer, Key, HeadID, LastError string
	Reason                           string // claus_bloquejades.motiu as stored: reintent or dlq
	Why                              string // Reason for people (keyorder.Reason.English)
	Since                            time.Time
	Behind                           []seqRow
}

type seqRow struct {
	Seq                     int64
	ID, Tipus, State, Where string
	Letter                  string
}

// sequencesOf returns the sequences of the keys whose blocked head is l's
// event, in every service's database (per-key order consumers; none
// without Config.ServiceDBs or Config.KeyOrder).
func (c *Console) sequencesOf(ctx context.Context, l *dlq.Letter) ([]seqView, error) {
	if l.EventID == "" {
		return nil, nil
	}
	var out []seqView
	for _, sdb := range c.serviceDBs() {
		vs, err := c.sequencesIn(ctx, sdb, l)
		if err != nil {
			return nil, err
		}
		out = append(out, vs...)
	}
	return out, nil
}

func (c *Console) sequencesIn(ctx context.Context, sdb ServiceDB, l *dlq.Letter) ([]seqView, error) {
	refs, err := dlq.BlockedHeads(ctx, sdb.DB, sdb.Schema, l.EventID)
	if err != nil {
		return nil, err
	}
	ko, err := keyorder.New(keyorder.Config{Schema: sdb.Schema})
	if err != nil {
		return nil, err
	}
	var out []seqView
	for _, ref := range refs {
		seq, err := dlq.KeySequence(ctx, c.cfg.Source, ko, sdb.DB, ref.Consumer, ref.Key)
		if errors.Is(err, dlq.ErrNotBlocked) {
			continue // released meanwhile
		}
		if err != nil {
			return nil, err
		}
		v := seqView{Service: sdb.Name, Consumer: dlq.Safe(seq.Consumer), Key: dlq.Safe(seq.Key), HeadID: dlq.Safe(seq.Head.MessageID),
			Reason: string(seq.Head.Reason), Why: seq.Head.Reason.English(), LastError: dlq.Safe(seq.Head.LastError), Since: seq.Head.Since}
		for _, p := range seq.Behind {
			if p.ID == seq.Head.MessageID {
				continue
			}
			row := seqRow{Seq: p.Seq, ID: dlq.Safe(p.ID), State: p.State.English(),
				Where: dlq.Safe(p.Topic) + "/" + strconv.Itoa(int(p.Partition)) + "/" + strconv.FormatInt(p.Offset, 10)}
			for _, h := range p.Headers {
				if h.Key == "tipus" {
					row.Tipus = dlq.Safe(h.Value)
				}
			}
			if ls := seq.BehindLetters[p.ID]; len(ls) > 0 {
				row.Letter = ls[0].ID
			}
			v.Behind = append(v.Behind, row)
		}
		out = append(out, v)
	}
	return out, nil
}

// blockedSequence reads the blocked sequence of key in consumer, kept in
// service's database (with the key-order store it was read through), for
// an action (replay, skip) on it. On a failure it
// has answered the request (404 unknown service, 409 a key no longer
// blocked) and ok is false.
func (c *Console) blockedSequence(ctx context.Context, w http.ResponseWriter, r *http.Request, service, consumer, key, action string) (ServiceDB, *keyorder.Store, *dlq.Sequence, bool) {
	sdb, ok := c.serviceDB(service)
	if !ok {
		c.errorPage(w, r, http.StatusNotFound, "this console shows no per-key order sequences of that service")
		return sdb, nil, nil, false
	}
	ko, err := keyorder.New(keyorder.Config{Schema: sdb.Schema})
	if err != nil {
		c.fail(w, r, err)
		return sdb, nil, nil, false
	}
	seq, err := dlq.KeySequence(ctx, c.cfg.Source, ko, sdb.DB, consumer, key)
	if errors.Is(err, dlq.ErrNotBlocked) {
		c.errorPage(w, r, http.StatusConflict, "this key is not blocked any more: nothing to "+action)
		return sdb, nil, nil, false
	}
	if err != nil {
		c.fail(w, r, err)
		return sdb, nil, nil, false
	}
	return sdb, ko, seq, true
}

// replaySequence replays a blocked key's sequence as one (dlq.ReplaySequence):
// the head's letter goes back to its topic, the consumer then applies the
// messages behind it in order, and their letters are marked purged. It then
// watches the head for Config.ReplayWatch (dlq.Source.Watch) and says
// whether the replay took or the consumer dead-lettered the head again.
func (c *Console) replaySequence(w http.ResponseWriter, r *http.Request) {
	if !c.needSource(w, r) {
		return
	}
	service, err0 := text(r.PostFormValue("servei"))
	consumer, err1 := text(r.PostFormValue("consumidor"))
	key, err2 := text(r.PostFormValue("clau"))
	if err0 != nil || err1 != nil || err2 != nil || consumer == "" || key == "" {
		c.errorPage(w, r, http.StatusBadRequest, "a sequence replay needs consumidor and clau")
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	_, _, seq, ok := c.blockedSequence(ctx, w, r, service, consumer, key, "replay")
	if !ok {
		return
	}
	rep, err := dlq.ReplaySequence(ctx, c.cfg.Source, seq, dlq.ReplayOptions{Retention: c.cfg.Retention, Actor: actorOf(r)})
	if errors.Is(err, dlq.ErrNoHeadLetter) {
		c.cfg.Logger.Warn("console: sequence replay refused", "consumidor", consumer, "err", err)
		c.errorPage(w, r, http.StatusConflict, "the sequence was not replayed: its head has no pending dead letter")
		return
	}
	if err != nil && rep == nil {
		c.fail(w, r, err)
		return
	}
	if err != nil {
		c.cfg.Logger.Error("console: sequence replay", "err", err)
	}
	data := map[string]any{"Service": service, "Consumer": dlq.Safe(consumer), "Key": dlq.Safe(key), "Report": rep,
		"Behind": len(seq.Behind) - ownRow(seq), "Failed": err != nil, "Watch": c.cfg.ReplayWatch.String()}
	if len(rep.Items) > 0 && rep.Items[0].Done {
		takes, werr := c.cfg.Source.Watch(ctx, c.cfg.ReplayWatch, 0, rep)
		switch {
		case werr != nil:
			c.cfg.Logger.Warn("console: watch of a sequence replay", "consumidor", consumer, "err", werr)
			data["WatchFailed"] = true
		case len(takes) == 1:
			data["Take"] = takes[0]
		}
	}
	c.cfg.Logger.Info("console: sequence replay", "consumidor", consumer, "done", rep.Done, "refused", rep.Refused)
	c.renderPage(w, r, http.StatusOK, "seqreplayed", page{Title: "Sequence replay: result", Data: data})
}

// selection is the preamble of every selection form: the dead letters'
// source must be there and the form must parse; with unconfirmed set, the
// form must also carry confirmo=1, else it answers 400 with unconfirmed. ok
// false: the answer is written.
func (c *Console) selection(w http.ResponseWriter, r *http.Request, unconfirmed string) (sel selection, ok bool) {
	if !c.needSource(w, r) {
		return sel, false
	}
	sel, err := parseSelection(r, c.cfg.Now())
	if errors.Is(err, errNoneTicked) && sel.Topic != "" && sel.Class != "" {
		// Back to the group's page, which says what happened.
		q := url.Values{"topic": {sel.Topic}, "classe": {sel.Class}, "avis": {"cap"}}
		if sel.N.Consumer != "" {
			q.Set("consumidor", sel.N.Consumer)
		}
		for _, p := range sel.N.Pairs() {
			q.Set(p.Name, p.Value)
		}
		http.Redirect(w, r, "/grup?"+q.Encode(), http.StatusSeeOther)
		return sel, false
	}
	if errors.Is(err, errNoneTicked) {
		c.errorPage(w, r, http.StatusBadRequest, "No letter is ticked: tick the letters to act on, or use the group's or the filter's button.")
		return sel, false
	}
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, err.Error())
		return sel, false
	}
	if unconfirmed != "" && r.PostFormValue("confirmo") != "1" {
		c.errorPage(w, r, http.StatusBadRequest, unconfirmed)
		return sel, false
	}
	return sel, true
}

// total is the number of letters in the groups of ls.
func total(ls *dlq.Listing) int {
	n := 0
	for _, g := range ls.Groups {
		n += g.Count
	}
	return n
}

func (c *Console) replayPreview(w http.ResponseWriter, r *http.Request) {
	sel, ok := c.selection(w, r, "")
	if !ok {
		return
	}
	rep, err := c.cfg.Source.Replay(r.Context(), sel.filter(), dlq.ReplayOptions{DryRun: true, Force: sel.Force, Retention: c.cfg.Retention})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ids, copies, err := c.foldReplay(r.Context(), sel, rep)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	isCopy := map[string]bool{}
	for _, id := range copies {
		isCopy[id] = true
	}
	items := make([]previewItem, 0, min(len(rep.Items), 200))
	for _, it := range rep.Items[:min(len(rep.Items), 200)] {
		items = append(items, previewItem{Item: it, Copy: isCopy[it.ID]})
	}
	tok := c.savePlan(&plan{kind: "replay", sel: sel.Describe(), ids: ids, copies: copies, created: c.cfg.Now()})
	c.renderPage(w, r, http.StatusOK, "preview", page{Title: "Replay: dry run", Data: map[string]any{
		"Sel": sel, "Report": rep, "Items": items, "More": len(rep.Items) - len(items), "Plan": tok,
		"Would": len(ids), "Copies": copies[:min(len(copies), 200)], "CopyCount": len(copies),
	}})
}

// previewItem is a row of a dry run: Copy marks a duplicate copy, marked
// purged when the replay of another copy of its event is confirmed.
type previewItem struct {
	dlq.Item
	Copy bool
}

// purgeable is f as a purge selects by it: pending and replayed letters
// unless f names letters by ID.
func purgeable(f dlq.Filter) dlq.Filter {
	if len(f.IDs) == 0 {
		f.States = []dlq.State{dlq.StatePending, dlq.StateReplayed}
	}
	return f
}

func (c *Console) purgeConfirm(w http.ResponseWriter, r *http.Request) {
	sel, ok := c.selection(w, r, "")
	if !ok {
		return
	}
	ids, err := c.cfg.Source.Snapshot(r.Context(), purgeable(sel.filter()))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	copies, err := c.purgeCopies(r.Context(), sel, ids)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ids = append(ids, copies...)
	tok := c.savePlan(&plan{kind: "purge", sel: sel.Describe(), ids: ids, created: c.cfg.Now()})
	c.renderPage(w, r, http.StatusOK, "purgeconfirm", page{Title: "Purge: confirm", Data: map[string]any{
		"Sel": sel, "Count": len(ids), "Copies": len(copies), "Rabbit": c.cfg.Broker == "RabbitMQ", "Plan": tok,
	}})
}

func (c *Console) purge(w http.ResponseWriter, r *http.Request) {
	sel, ok := c.selection(w, r, "purge not confirmed")
	if !ok {
		return
	}
	p := c.takePlan(r.PostFormValue("pla"), "purge")
	if p == nil {
		c.errorPage(w, r, http.StatusConflict, errNoPlan)
		return
	}
	del := r.PostFormValue("delete_records") == "1" && c.cfg.Broker != "RabbitMQ"
	// Not the request's context: a purge cut short by a closed tab would
	// leave the operator unsure of what happened.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
	defer cancel()
	rep := &dlq.Report{}
	var err error
	if len(p.ids) > 0 { // Filter{IDs: none} would select every letter
		rep, err = c.cfg.Source.Purge(ctx, dlq.Filter{IDs: p.ids}, dlq.PurgeOptions{Confirmed: true, DeleteRecords: del, Actor: actorOf(r)})
	}
	if err != nil && rep == nil {
		c.fail(w, r, err)
		return
	}
	data := map[string]any{"Sel": sel, "Report": rep, "Rabbit": c.cfg.Broker == "RabbitMQ", "Deleted": del}
	if sel.Scope != "seleccio" { // ticked letters: nothing can arrive in them
		if n, aerr := c.cfg.Source.Arrived(ctx, purgeable(sel.filter()), p.ids); aerr == nil && n > 0 {
			data["Arrived"] = n
		}
	}
	if err != nil {
		c.cfg.Logger.Error("console: purge", "err", err)
		data["Error"] = "the letters were marked purged, but deleting their records failed; the server log has the details"
	}
	c.cfg.Logger.Info("console: purge", "selection", sel.Describe(), "purged", rep.Done, "refused", rep.Refused)
	c.renderPage(w, r, http.StatusOK, "purged", page{Title: "Purge: result", Data: data})
}
