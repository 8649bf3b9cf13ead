package relay

import (
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/km0/km0/migrate"
	"github.com/km0/km0/relay/internal/relaycore"
)

// notifyChannel is the channel the outbox trigger notifies at commit, with the
// payload "<schema>.<table>" (migrate/sql/outbox/002_ordre_i_avis.sql).
const notifyChannel = "km0_outbox"

// shardExpr maps a row to its shard. The same expression is used by every
// relay instance; see ShardCount.
const shardExpr = "((hashtext(o.agregat_id) & 2147483647) % 64)"

// memberObjID, lockSpace and lockKey name the advisory locks of the relay
// workers (relaycore, shared with the CDC relay).
const memberObjID = relaycore.MemberObjID

func lockSpace(n migrate.Names) uint32         { return relaycore.LockSpace(n) }
func lockKey(space uint32, objID uint32) int64 { return relaycore.LockKey(space, objID) }

// queries are the statements of one outbox table.
type queries struct {
	claim    string // $1 owned shards int[], $2 limit
	claimAll string // $1 limit; when a worker owns every shard
	mark     string // $1 ctids tid[] of rows locked by this transaction
	park     string // $1 ids uuid[], $2 agregat_ids text[], $3 reasons text[]
	lag      string
	members  string // $1 lock space (bigint), $2 member objid
	acquire  string // $1 shards int[], $2 key of shard 0
	// acquireXact is acquire for one transaction (a pooled relay).
	acquireXact string
	release     string // $1 shards int[], $2 key of shard 0
	join        string // $1 member key
	payload     string // NOTIFY payload of this table
	size        string // $1 the table's quoted name
	name        string // the table's quoted, schema-qualified name
}

// newQueries returns the statements of n's outbox; del makes the mark a
// DELETE (Config.DeletePublished).
func newQueries(n migrate.Names, del bool) queries {
	n = n.WithDefaults()
	table := pgx.Identifier{n.Schema, n.Outbox}.Sanitize()
	parked := pgx.Identifier{n.Schema, n.Outbox + "_aparcats"}.Sanitize()
	claim := func(shardFilter, limit string) string {
		// capcaleres is read only for the rows that have it, after the
		// sort and the LIMIT: the claim sorts every pending row it scans,
		// and carrying a NULL column through that sort costs a null bitmap
		// per row (3% more to sort); a NOT NULL boolean costs one byte. The
		// subquery scan passes the claimed rows on in the inner ORDER BY's
		// order. The lookup by ctid reads the version the claim locked.
		return "SELECT c.id, c.agregat, c.agregat_id, c.tipus, c.versio, c.carrega, c.creat_en, c.ctid," +
			" CASE WHEN c.te_capcaleres THEN (SELECT x.capcaleres FROM " + table + " x WHERE x.ctid = c.ctid) END FROM (" +
			"SELECT o.id, o.agregat, o.agregat_id, o.tipus, o.versio, o.carrega, o.creat_en, o.ctid," +
			" o.capcaleres IS NOT NULL AS te_capcaleres FROM " + table + " o" +
			" WHERE o.publicat_en IS NULL" + shardFilter +
			// Skip aggregates with a parked row. Written as an OR so that
			// PostgreSQL hashes the (small) parking table once instead of
			// probing its index for every row, and skips even that when it
			// is empty.
			" AND (NOT EXISTS (SELECT 1 FROM " + parked + ")" +
			" OR NOT EXISTS (SELECT 1 FROM " + parked + " p WHERE p.agregat_id = o.agregat_id))" +
			" ORDER BY o.creat_en, o.id LIMIT " + limit + " FOR UPDATE OF o SKIP LOCKED) c"
	}
	return queries{
		claim:    claim(" AND "+shardExpr+" = ANY($1::int[])", "$2"),
		claimAll: claim("", "$1"),
		// By ctid: the claim locked these row versions FOR UPDATE in the same
		// transaction, so their ctids cannot change before this UPDATE; a TID
		// scan costs a quarter of 1,000 primary-key probes.
		mark: relaycore.MarkSQL(table, del, "ctid = ANY($1::tid[])"),
		park: relaycore.ParkSQL(n),
		lag: "SELECT count(*), coalesce(extract(epoch FROM now() - min(creat_en)), 0)::float8 FROM " + table +
			" WHERE publicat_en IS NULL",
		members: `SELECT count(*) FILTER (WHERE objid = $2::bigint::oid),
			coalesce(array_agg(objid::bigint::int) FILTER (WHERE objid::bigint < ` + strconv.Itoa(ShardCount) + ` AND pid <> pg_backend_pid()), '{}')
			FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND classid = $1::bigint::oid`,
		acquire:     "SELECT s FROM unnest($1::int[]) AS s WHERE pg_try_advisory_lock($2::bigint + s)",
		acquireXact: "SELECT s FROM unnest($1::int[]) AS s WHERE pg_try_advisory_xact_lock($2::bigint + s) ORDER BY s",
		release:     "SELECT count(*) FILTER (WHERE pg_advisory_unlock($2::bigint + s)) FROM unnest($1::int[]) AS s",
		join:        "SELECT pg_advisory_lock_shared($1::bigint)",
		payload:     n.Schema + "." + n.Outbox,
		size:        "SELECT pg_total_relation_size($1::text::regclass)",
		name:        table,
	}
}
