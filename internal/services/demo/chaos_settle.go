package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/km0/km0/internal/services/analitica"
	"github.com/km0/km0/internal/services/cataleg"
	"github.com/km0/km0/internal/services/comandes"
	"github.com/km0/km0/internal/services/inventari"
	"github.com/km0/km0/internal/services/pagaments"
	"github.com/km0/km0/internal/services/repartiment"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/services/system"
)

// publishing are the services with an outbox.
var publishing = []string{comandes.Name, inventari.Name, pagaments.Name, repartiment.Name}

// chaosGroups are the consumer groups whose lag must reach 0: the
// services' domain consumers and, with authorisations, the request/reply servers.
func (c *chaos) chaosGroups() []string {
	g := []string{comandes.ConsumerPaymentConfirmed, inventari.ConsumerDecrement, pagaments.ConsumerCharge,
		repartiment.ConsumerAssign, analitica.ConsumerCount, cataleg.ConsumerLowStock, comandes.ConsumerStockRefused, comandes.ConsumerDelivery}
	if !c.cfg.NoAuthorize && os.Getenv("KM0_AMQP_URL") == "" {
		g = append(g, pagaments.AuthQueue+".servidor")
	}
	return g
}

// pool opens a small pool on service's database of this run.
func (c *chaos) pool(ctx context.Context, service string) (*pgxpool.Pool, error) {
	u, err := svc.WithDatabase(c.server.URL, svc.DatabaseName(service, c.suffix))
	if err != nil {
		return nil, err
	}
	return svc.OpenPool(ctx, u, 2)
}

// pools opens a pool on every service's database, retrying while the server
// does not answer, up to ctx.
func (c *chaos) pools(ctx context.Context) (map[string]*pgxpool.Pool, error) {
	out := map[string]*pgxpool.Pool{}
	for _, s := range system.Services {
		for {
			p, err := c.pool(ctx, s)
			if err == nil {
				out[s] = p
				break
			}
			select {
			case <-ctx.Done():
				closePools(out)
				return nil, fmt.Errorf("database of %s: %w", s, err)
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	return out, nil
}

func closePools(m map[string]*pgxpool.Pool) {
	for _, p := range m {
		p.Close()
	}
}

// settle waits until every child runs, no outbox row is pending, every
// group's lag is 0 and no delivery is pending, three polls in a row, or
// until deadline. On a timeout it returns the groups and partitions that
// still lag, with the member that holds each.
func (c *chaos) settle(ctx context.Context, deadline time.Time) (bool, string, []string) {
	pctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	pools, err := c.pools(pctx)
	if err != nil {
		return false, err.Error(), nil
	}
	defer closePools(pools)
	adm := kadm.NewClient(c.kcl)
	stable, last := 0, ""
	lastSaid := time.Now()
	for {
		var notes []string
		var down []string
		for name, p := range c.allProcs() {
			if !p.running() {
				down = append(down, name)
			}
		}
		sort.Strings(down)
		if len(down) > 0 {
			notes = append(notes, "down: "+strings.Join(down, ", "))
		}
		pending := 0
		for _, s := range publishing {
			var n int
			qctx, qcancel := context.WithTimeout(pctx, 5*time.Second)
			err := pools[s].QueryRow(qctx, `SELECT count(*) FROM outbox WHERE publicat_en IS NULL`).Scan(&n)
			qcancel()
			if err != nil {
				pending = -1
				notes = append(notes, fmt.Sprintf("outbox of %s: %v", s, err))
				break
			}
			pending += n
		}
		var lag int64
		var behind []string
		lctx, lcancel := context.WithTimeout(pctx, 5*time.Second)
		lags, err := groupLag(lctx, c.kcl, c.chaosGroups())
		lcancel()
		if err != nil {
			lag = -1
			notes = append(notes, err.Error())
		}
		for _, g := range c.chaosGroups() {
			l, ok := lags[g]
			if !ok {
				lag = -1
				continue
			}
			lag += l
			if l > 0 {
				behind = append(behind, fmt.Sprintf("%s %d", g, l))
			}
		}
		var pendDeliv int
		qctx, qcancel := context.WithTimeout(pctx, 5*time.Second)
		if err := pools[repartiment.Name].QueryRow(qctx, `SELECT count(*) FROM lliuraments WHERE estat = 'pendent'`).Scan(&pendDeliv); err != nil {
			pendDeliv = -1
		}
		qcancel()
		last = fmt.Sprintf("outbox rows pending %d, lag %d (%s), deliveries pending %d", pending, lag, listOr(behind, "none behind"), pendDeliv)
		if len(notes) > 0 {
			last += " (" + strings.Join(notes, "; ") + ")"
		}
		if len(down) == 0 && pending == 0 && lag == 0 && pendDeliv == 0 {
			stable++
			if stable >= 3 {
				return true, last, nil
			}
		} else {
			stable = 0
		}
		if time.Since(lastSaid) > 5*time.Second {
			c.say("settling: %s", last)
			lastSaid = time.Now()
		}
		select {
		case <-pctx.Done():
			dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
			defer dcancel()
			return false, "temps esgotat: " + last, stuckPartitions(dctx, adm, c.chaosGroups())
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// stuckPartitions names every partition with lag: group, topic/partition,
// committed and end offsets, the member that holds it and the group's state.
func stuckPartitions(ctx context.Context, adm *kadm.Client, groups []string) []string {
	lags, err := adm.Lag(ctx, groups...)
	if err != nil {
		return []string{"lag: " + err.Error()}
	}
	var out []string
	lags.Each(func(l kadm.DescribedGroupLag) {
		if l.DescribeErr != nil || l.FetchErr != nil {
			out = append(out, fmt.Sprintf("%s: %v", l.Group, errors.Join(l.DescribeErr, l.FetchErr)))
			return
		}
		members := make([]string, 0, len(l.Members))
		for _, m := range l.Members {
			members = append(members, m.ClientID+"@"+m.ClientHost+"/"+m.MemberID)
		}
		for _, ml := range l.Lag.Sorted() {
			if ml.Lag <= 0 {
				continue
			}
			holder := "no member"
			if ml.Member != nil {
				holder = ml.Member.MemberID
			}
			out = append(out, fmt.Sprintf("%s %s/%d: lag %d (committed %d, end %d), assigned to %s; group %s with %d members (%s)",
				l.Group, ml.Topic, ml.Partition, ml.Lag, ml.Commit.At, ml.End.Offset, holder, l.State, len(l.Members), listOr(members, "none")))
		}
	})
	return out
}
