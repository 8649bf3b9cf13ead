package console_test

import (
	"net/url"
	"strings"
	"testing"
)

// The pages say a letter's state in English (pending, replayed, purged,
// all), while their links and forms carry the index's estat as the
// contract spells it; an English estat in the address selects the same.
func TestPagesShowStatesInEnglish(t *testing.T) {
	t.Parallel()
	b := setup(t, token)
	ids := b.produceDead(t, 1, class+": x")
	br := b.browser(t)
	br.login(token)

	pages := []struct {
		path       string
		want, lack []string
	}{
		{"/", []string{`(showing <b id="estat">pending</b>)`, `name="estat" value="pendent"`}, []string{`>pendent<`}},
		{"/?estat=replayed", []string{`(showing <b id="estat">replayed</b>)`, `name="estat" value="reproduida"`}, nil},
		{"/?estat=totes", []string{`(showing <b id="estat">all</b>)`, `name="estat" value="totes"`}, nil},
		{"/grup?topic=" + comandesDLQ + "&classe=" + url.QueryEscape(class),
			[]string{`letter(s) (pending)`, `<td>pending</td>`, `id="replay-group"`}, []string{`pendent`}},
		// An English estat is the stored one: the group's buttons of
		// pending letters are there.
		{"/grup?topic=" + comandesDLQ + "&classe=" + url.QueryEscape(class) + "&estat=pending",
			[]string{`letter(s) (pending)`, `id="replay-group"`}, nil},
		{"/carta?id=" + url.QueryEscape(ids[0]), []string{`<td>pending (replays 0)</td>`}, []string{`pendent`}},
	}
	for _, p := range pages {
		_, body := br.get(p.path)
		for _, w := range p.want {
			if !strings.Contains(body, w) {
				t.Errorf("%s lacks %q:\n%s", p.path, w, body)
			}
		}
		for _, l := range p.lack {
			if strings.Contains(body, l) {
				t.Errorf("%s shows %q:\n%s", p.path, l, body)
			}
		}
	}
}
