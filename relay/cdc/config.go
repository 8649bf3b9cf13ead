package cdc

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"time"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay"
)

// Defaults of Config.
const (
	// BatchSizeDefault is the most rows the relay hands to the broker in one
	// Publish (waiting for every confirmation) before it marks them and
	// confirms their position to the server.
	BatchSizeDefault = 2000
	// BatchSizeMax bounds BatchSize.
	BatchSizeMax = 10_000
	// StatusIntervalDefault is how often the relay reports its confirmed
	// position to the server (standby status update) when nothing else
	// prompts it. While the outbox is idle this is what advances the slot.
	StatusIntervalDefault = time.Second
	// ReleaseCheckDefault is how often, while some aggregate waits behind a
	// parked row, the relay looks for rows an operator released.
	ReleaseCheckDefault = time.Second
	// ApplicationNameDefault is the application_name of the CDC relay's
	// sessions.
	ApplicationNameDefault = "km0-relay-cdc"
)

// ErrConfig is wrapped by every error New returns for an invalid Config.
var ErrConfig = errors.New("cdc: invalid config")

// Config configures a CDC Relay. The embedded relay.Config carries what the
// polling relay also takes: Pool or DatabaseURL, Names, Publisher, Topic and
// Origin (required), Transform, MaxRecordBytes, PublishTimeout, BackoffMin,
// BackoffMax, Logger, Metrics and the Prune settings. Its BatchSize, Workers,
// PollInterval and RebalanceInterval do not apply.
type Config struct {
	relay.Config
	// Slot is the logical replication slot: lower-case letters, digits and
	// underscores, at most 63. Default DefaultSlotIn(<the database>, Names),
	// or migrate.WALSlot in WAL mode.
	Slot string
	// Publication is the publication of the outbox table (inserts only),
	// created if absent. Default DefaultPublication(Names).
	Publication string
	// BatchSize is the most rows per Publish, 1..BatchSizeMax. Default
	// BatchSizeDefault. A batch is whatever the stream has delivered when the
	// previous one was confirmed, up to this size: a lone event goes out at
	// once.
	BatchSize int
	// StatusInterval is the period of the standby status updates. Default
	// StatusIntervalDefault.
	StatusInterval time.Duration
	// ReleaseCheck is the period of the check for released rows. Default
	// ReleaseCheckDefault.
	ReleaseCheck time.Duration
	// WAL makes the relay publish the outbox's logical decoding messages
	// (outbox.ModeWAL, the prefix migrate.WALPrefix(Names)) instead of the
	// table's inserts: nothing is marked, a refused event and the later
	// events of its aggregate are parked in <outbox>_wal_aparcats, and the
	// slot's position is the only record of what is published. Then Slot
	// defaults to migrate.WALSlot(<database>, Names) and Publication (empty:
	// it publishes no table) to the same name; PruneOlderThan and
	// DeletePublished are refused.
	// Default false (the table mode).
	WAL bool
}

// maxName is NAMEDATALEN - 1, the longest slot or publication name.
const maxName = 63

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// ValidSlot reports whether s is a slot name PostgreSQL accepts.
func ValidSlot(s string) bool { return slotName.MatchString(s) }

// DefaultSlotIn is the default slot of the outbox n of database:
// km0_<database>_<schema>_<table> (migrate.SlotName: lower-cased, with a
// hash of the exact names when they had to be changed or cut). Slots are
// server-wide, so the database is in the name: two databases' outboxes with
// the same schema and table never share a slot.
func DefaultSlotIn(database string, n migrate.Names) string {
	n = n.WithDefaults()
	return migrate.SlotName("km0", database, n.Schema, n.Outbox)
}

// DefaultSlot is the slot name of an outbox that leaves out the database
// (km0_<schema>_<table>, km0_public_outbox for the contract's table), the
// default before DefaultSlotIn. A relay whose Slot is defaulted refuses to
// create DefaultSlotIn's slot while this one exists in its database, so
// that an upgrade never leaves a slot holding WAL behind: pass it as Slot
// to keep its position. Also the default publication's name.
func DefaultSlot(n migrate.Names) string {
	n = n.WithDefaults()
	name := "km0_" + n.Schema + "_" + n.Outbox
	if slotName.MatchString(name) {
		return name
	}
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	s := b.String()
	if len(s) > maxName-9 {
		s = s[:maxName-9]
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(n.Schema + "\x00" + n.Outbox))
	return fmt.Sprintf("%s_%08x", s, h.Sum32())
}

// DefaultPublication is the default publication of an outbox: the same name
// as DefaultSlot (it is always quoted where it is used).
func DefaultPublication(n migrate.Names) string { return DefaultSlot(n) }

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	c.ApplicationName = cmp.Or(c.ApplicationName, ApplicationNameDefault)
	c.Config = c.Config.WithDefaults()
	// Slot: New names it after the database (and the publication in WAL
	// mode after the slot).
	if !c.WAL {
		c.Publication = cmp.Or(c.Publication, DefaultPublication(c.Names))
	}
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.StatusInterval = cmp.Or(c.StatusInterval, StatusIntervalDefault)
	c.ReleaseCheck = cmp.Or(c.ReleaseCheck, ReleaseCheckDefault)
	return c
}

func (c Config) validate() error {
	errs := c.Config.CheckShared()
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Slot != "" && !slotName.MatchString(c.Slot) {
		bad("Slot %q is not a slot name: 1 to 63 lower-case letters, digits and underscores", c.Slot)
	}
	if len(c.Publication) > maxName || strings.ContainsRune(c.Publication, 0) {
		bad("Publication %q is longer than 63 bytes or holds a NUL", c.Publication)
	}
	if c.WAL && c.PruneOlderThan > 0 {
		bad("PruneOlderThan does not apply in WAL mode: there is no outbox row to prune")
	}
	if c.WAL && c.DeletePublished {
		bad("DeletePublished does not apply in WAL mode: there is no outbox row to delete")
	}
	if c.BatchSize < 1 || c.BatchSize > BatchSizeMax {
		bad("BatchSize %d is outside 1..%d", c.BatchSize, BatchSizeMax)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"StatusInterval", c.StatusInterval}, {"ReleaseCheck", c.ReleaseCheck}} {
		if d.v < 0 {
			bad("%s %v is negative", d.name, d.v)
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrConfig, errors.Join(errs...))
}
