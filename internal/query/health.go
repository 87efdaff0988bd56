package query

import (
	"fmt"
	"strings"
)

// Health statements: the outbox's storage and what holds its vacuum back.
// They read catalogs and statistics views only, which every role may
// read, so they need no grant beyond USAGE on the outbox's schema. The
// size functions take a shared lock on every table and index they measure
// until the caller's transaction ends: run them outside long transactions.
// They wait behind an exclusive lock (a VACUUM FULL, an ALTER TABLE, a
// REINDEX, or one of them queued for its lock), so TableHealth measures
// only what no session holds or awaits such a lock on, and reports the
// rest as locked: Health answers in the very moment it is run for.

// TableHealth reads the statistics of the tables $1, $2 and $3 (quoted,
// qualified names of the outbox, the dead-letter and the arrivals table;
// $2 and $3 may be NULL), one row per table that exists: which (1, 2 or
// 3), n_live_tup, n_dead_tup, table and index bytes, the four
// (auto)vacuum and (auto)analyze times, whether autovacuum visits the
// table (the server's setting and the table's autovacuum_enabled), the
// server's track_counts, and whether it was locked. The counts come from
// the cumulative statistics: estimates, updated when backends report,
// zero while track_counts is off. A partitioned table reports its
// partitions: the sums of their counts and sizes, autovacuum only if it
// visits every one of them, and the oldest partition's vacuum and analyze
// times (NULL while one has none), so a neglected partition is not hidden
// by a fresh one. The partitions, two levels deep at most, are found in
// pg_inherits, which takes no lock (pg_partition_tree locks every
// partition). A partition is locked
// when a session (or a prepared transaction) holds or awaits an exclusive
// lock on it, its TOAST table, an index of either, or the table it is a
// partition of: its sizes are not read (they count 0), since the size
// functions would wait for that lock. The counts and times come from the
// functions behind pg_stat_user_tables, called for these tables only: a
// join with the view computed it for every table of the database, and the
// plan's cost on a database of some thousands of tables passed
// jit_above_cost and made it JIT-compiled, a second a call
// (TestHealthIsNotJITCompiled).
const TableHealth = `WITH t(which, oid) AS (
    SELECT * FROM (VALUES (1, to_regclass($1::text)::oid), (2, to_regclass($2::text)::oid), (3, to_regclass($3::text)::oid)) AS v(which, oid)
     WHERE v.oid IS NOT NULL
), tree(which, root, relid) AS (
    SELECT which, oid, oid FROM t
     UNION ALL
    SELECT t.which, t.oid, i.inhrelid FROM t JOIN pg_inherits i ON i.inhparent = t.oid
     UNION ALL
    SELECT t.which, t.oid, i2.inhrelid FROM t JOIN pg_inherits i ON i.inhparent = t.oid JOIN pg_inherits i2 ON i2.inhparent = i.inhrelid
), excl AS (
    SELECT DISTINCT l.relation FROM pg_locks l
     WHERE l.locktype = 'relation' AND l.mode = 'AccessExclusiveLock' AND l.pid IS DISTINCT FROM pg_backend_pid()
       AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
), rels AS MATERIALIZED (
    -- Through arrays: the planner takes an unnest for a few rows, where
    -- its estimates of the joins above (from a catalog's stale
    -- statistics) reached a cost that JIT-compiles the statement.
    SELECT array_agg(which) AS w, array_agg(root) AS r, array_agg(relid) AS id FROM tree
), p AS (
    SELECT u.which, u.relid,
           EXISTS (SELECT FROM excl
                    WHERE excl.relation IN (u.relid, u.root, c.reltoastrelid)
                       OR excl.relation IN (SELECT x.indexrelid FROM pg_index x WHERE x.indrelid IN (u.relid, c.reltoastrelid))) AS locked
      FROM rels CROSS JOIN unnest(rels.w, rels.r, rels.id) AS u(which, root, relid)
      JOIN LATERAL (SELECT c.relkind, c.reltoastrelid FROM pg_class c WHERE c.oid = u.relid) AS c ON true
     WHERE c.relkind <> 'p'
)
SELECT p.which,
       coalesce(sum(s.n_live_tup), 0)::bigint, coalesce(sum(s.n_dead_tup), 0)::bigint,
       coalesce(sum(CASE WHEN NOT p.locked THEN pg_table_size(p.relid) END), 0)::bigint,
       coalesce(sum(CASE WHEN NOT p.locked THEN pg_indexes_size(p.relid) END), 0)::bigint,
       CASE WHEN bool_and(s.last_vacuum IS NOT NULL) THEN min(s.last_vacuum) END,
       CASE WHEN bool_and(s.last_autovacuum IS NOT NULL) THEN min(s.last_autovacuum) END,
       CASE WHEN bool_and(s.last_analyze IS NOT NULL) THEN min(s.last_analyze) END,
       CASE WHEN bool_and(s.last_autoanalyze IS NOT NULL) THEN min(s.last_autoanalyze) END,
       current_setting('autovacuum')::bool,
       bool_and(coalesce((SELECT o.option_value::bool FROM pg_class c, pg_options_to_table(c.reloptions) o
                           WHERE c.oid = p.relid AND o.option_name = 'autovacuum_enabled'), true)),
       current_setting('track_counts')::bool,
       bool_or(p.locked)
  FROM p
 CROSS JOIN LATERAL (SELECT pg_stat_get_live_tuples(p.relid) AS n_live_tup, pg_stat_get_dead_tuples(p.relid) AS n_dead_tup,
                            pg_stat_get_last_vacuum_time(p.relid) AS last_vacuum,
                            pg_stat_get_last_autovacuum_time(p.relid) AS last_autovacuum,
                            pg_stat_get_last_analyze_time(p.relid) AS last_analyze,
                            pg_stat_get_last_autoanalyze_time(p.relid) AS last_autoanalyze) AS s
 GROUP BY p.which
 ORDER BY p.which`

// SnapshotHolders lists what keeps vacuum from removing the outbox's dead
// rows, oldest first, at most $1 of each kind: sessions of this database
// (and walsenders, whose hot_standby_feedback holds every database) with
// an xmin or an xid, other than the caller's own and VACUUMs (whose xmin
// other vacuums ignore). Walsenders are found through pg_stat_replication:
// pg_stat_activity hides backend_type from a role without
// pg_read_all_stats; replication slots with an
// xmin or a catalog_xmin (the latter only holds the catalogs: catalog_only);
// prepared transactions of this database. A parallel query's workers
// hold their leader's snapshot: the leader stands for them. Sessions of
// other databases are
// left out: they do not hold back this database's tables. xid_age is
// age() of the oldest of the holder's xids; age_us how long since its
// transaction began or was prepared (NULL when unknown: slots record no
// time, and pg_stat_activity hides xact_start of other roles' sessions
// from a role without pg_read_all_stats). No query text is read: it may
// hold secrets.
const SnapshotHolders = `SELECT kind, pid, usr, app, btype, state, name, slot_type, active, catalog_only, db, xid_age, since,
       (extract(epoch FROM clock_timestamp() - since) * 1000000)::bigint
  FROM (
(SELECT 'backend' AS kind, a.pid AS pid, coalesce(a.usename::text, '') AS usr,
        coalesce(a.application_name, '') AS app,
        coalesce(a.backend_type, CASE WHEN w.pid IS NOT NULL THEN 'walsender' END, '') AS btype, coalesce(a.state, '') AS state,
        '' AS name, '' AS slot_type, false AS active, false AS catalog_only, coalesce(a.datname::text, '') AS db,
        greatest(age(a.backend_xid), age(a.backend_xmin))::bigint AS xid_age, a.xact_start AS since
   FROM pg_stat_activity a
   LEFT JOIN pg_stat_replication w ON w.pid = a.pid
  WHERE a.pid <> pg_backend_pid()
    AND (a.leader_pid IS NULL OR a.leader_pid = a.pid)
    AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    AND (a.datname = current_database() OR w.pid IS NOT NULL)
    AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.pid = a.pid)
  ORDER BY xid_age DESC, a.xact_start
  LIMIT $1)
UNION ALL
(SELECT 'replication_slot', coalesce(r.active_pid, 0), '', '', '', '',
        r.slot_name::text, coalesce(r.slot_type, ''), r.active, r.xmin IS NULL, coalesce(r.database::text, ''),
        coalesce(age(r.xmin), age(r.catalog_xmin))::bigint AS xid_age, NULL::timestamptz
   FROM pg_replication_slots r
  WHERE r.xmin IS NOT NULL OR r.catalog_xmin IS NOT NULL
  ORDER BY xid_age DESC
  LIMIT $1)
UNION ALL
(SELECT 'prepared_xact', 0, coalesce(p.owner::text, ''), '', '', '',
        p.gid, '', false, false, coalesce(p.database::text, ''),
        age(p.transaction)::bigint AS xid_age, p.prepared
   FROM pg_prepared_xacts p
  WHERE p.database = current_database()
  ORDER BY xid_age DESC
  LIMIT $1)
) h
 ORDER BY xid_age DESC, since`

// ringHealth reads the ring of the rotating outbox n: per ring partition,
// its generation and estimated live rows, with the current generation and
// the milliseconds since it became current (NULLs when the role may not
// read the generation sequence: pg_sequences hides its value). Catalogs
// and statistics only, like TableHealth; no arrays, for every driver.
func ringHealth(n Names) string {
	var parts []string
	for g, name := range n.Generations[:RingSize] {
		parts = append(parts, fmt.Sprintf("(%d, %s)", g, literal(name)))
	}
	// The partitions' counts from the statistics functions, as in
	// TableHealth: a join with pg_stat_user_tables computes the view for
	// every table of the schema.
	return fmt.Sprintf(`SELECT p.g, coalesce(pg_stat_get_live_tuples(to_regclass(quote_ident(%[3]s) || '.' || quote_ident(p.name))), 0),
       (s.last_value %% %[1]d)::int,
       floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - s.last_value / %[1]d
  FROM (VALUES %[2]s) AS p(g, name)
  LEFT JOIN pg_catalog.pg_sequences s ON s.schemaname = %[3]s AND s.sequencename = %[4]s
 ORDER BY p.g`, RingSize, strings.Join(parts, ", "), literal(n.Schema), literal(n.GenSeq))
}
