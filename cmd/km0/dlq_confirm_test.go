package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/km0/km0/internal/dlqcli"
)

// onRead runs once before the first Read: the operator's "y" arrives after it.
type onRead struct {
	before func()
	r      io.Reader
	done   bool
}

func (o *onRead) Read(p []byte) (int, error) {
	if !o.done {
		o.done = true
		o.before()
	}
	return o.r.Read(p)
}

// `km0 dlq purge` asks "Purge 4 dead letter(s)?" and purges those 4: two
// letters that die and are indexed while the question waits stay pending,
// and the output says so.
func TestDLQPurgeConfirmationActsOnTheLettersItCounted(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	value := `{"id_esdeveniment":"e-1","tipus":"comanda.creada","versio":1,"data_ms":` +
		jsonNumber(time.Now().UnixMilli()) + `,"origen":"comandes","dades":{"id":"P-1"}}`
	for i := 0; i < 4; i++ {
		h.dead("P-1", "permanent: esquema: x", []byte(value))
	}
	in := &onRead{r: strings.NewReader("y\n"), before: func() {
		h.dead("P-2", "permanent: esquema: y", []byte(value))
		h.dead("P-2", "permanent: esquema: y", []byte(value))
		if out, err := h.run("", false, "ls"); err != nil || !strings.Contains(out, "6 dead letter(s)") {
			t.Errorf("ls while the question waits: %v\n%s", err, out)
		}
	}}
	var out bytes.Buffer
	c := &dlqcli.CLI{Out: &out, ErrOut: &out, In: in, TTY: true, Now: time.Now}
	args := append(append([]string{"purge"}, h.base...), "--reason", "permanent: esquema")
	if err := c.Run(context.Background(), args); err != nil {
		t.Fatalf("purge: %v\n%s", err, out.String())
	}
	if s := out.String(); !strings.Contains(s, "Purge 4 dead letter(s)?") || !strings.Contains(s, "4 letter(s) marked purged") ||
		!strings.Contains(s, "2 letter(s) arrived while the question waited and were not purged") {
		t.Fatalf("purge output:\n%s", s)
	}
	if out, err := h.run("", false, "ls", "--state", "pending"); err != nil || !strings.Contains(out, "2 dead letter(s)") {
		t.Fatalf("pending after the purge: %v\n%s", err, out)
	}
}

// `km0 dlq replay --plan FILE` replays exactly the letters its dry run
// listed: the dry run lists 3, 2 more die, the replay with the plan replays
// the 3, leaves the 2 pending and says they arrived.
func TestDLQReplayPlanActsOnTheLettersTheDryRunListed(t *testing.T) {
	t.Parallel()
	h := newDLQHarness(t)
	value := `{"id_esdeveniment":"e-1","tipus":"comanda.creada","versio":1,"data_ms":` +
		jsonNumber(time.Now().UnixMilli()) + `,"origen":"comandes","dades":{"id":"P-1"}}`
	for i := 0; i < 3; i++ {
		h.dead("P-1", "permanent: esquema: x", []byte(value))
	}
	var stdout, stderr bytes.Buffer
	c := &dlqcli.CLI{Out: &stdout, ErrOut: &stderr, In: strings.NewReader(""), Now: time.Now}
	if err := c.Run(context.Background(), append(append([]string{"replay"}, h.base...), "--reason", "permanent: esquema", "--dry-run", "--json")); err != nil {
		t.Fatalf("dry run: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	plan := t.TempDir() + "/plan.json"
	if err := os.WriteFile(plan, stdout.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	h.dead("P-2", "permanent: esquema: y", []byte(value))
	h.dead("P-2", "permanent: esquema: y", []byte(value))
	out, err := h.run("", false, "replay", "--reason", "permanent: esquema", "--plan", plan)
	if err != nil || !strings.Contains(out, "3 selected, 3 replayed, 0 refused") ||
		!strings.Contains(out, "2 letter(s) of the selection arrived after the dry run and were not replayed") {
		t.Fatalf("replay --plan: %v\n%s", err, out)
	}
	if out, err := h.run("", false, "ls", "--state", "pending"); err != nil || !strings.Contains(out, "2 dead letter(s)") {
		t.Fatalf("pending after the planned replay: %v\n%s", err, out)
	}
}
