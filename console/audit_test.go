package console_test

import (
	"strings"
	"testing"

	"github.com/km0/km0/dlq"
)

// The audit log page reads English: an entry the index stores as accio
// purga, resultat fet shows "purge" and "done"; the row's data-action keeps
// the stored value for scripts.
func TestAuditPageSaysTheActionAndResultInEnglish(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 2, "permanent: esquema: x")
	if _, err := b.svc.Purge(b.ctx, dlq.Filter{IDs: ids[:1]}, dlq.PurgeOptions{Confirmed: true, Actor: "cli:anna@host"}); err != nil {
		t.Fatal(err)
	}
	br := b.browser(t)
	br.login(token)
	_, body := br.get("/auditoria")
	if strings.Count(body, `class="audit-entry"`) != 1 || !strings.Contains(body, `data-action="purga"`) ||
		!strings.Contains(body, "<td>purge</td>") || !strings.Contains(body, "<td>done</td>") || strings.Contains(body, "<td>fet</td>") {
		t.Fatalf("the audit log page:\n%s", body)
	}
}
