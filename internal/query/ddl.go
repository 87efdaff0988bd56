package query

import (
	"fmt"
	"strings"
	"unicode"
)

// Column is one column the code relies on, with the type format_type() reports.
type Column struct {
	Name string
	Type string
	Decl string // the declaration that adds it to an existing table, when it is more than Type
}

// OutboxColumns are the columns of the outbox table, in DDL order.
var OutboxColumns = []Column{
	{"id", "bigint", ""},
	{"topic", "text", ""},
	{"consumer_group", "text", ""},
	{"uuid", "text", ""},
	{"payload", "bytea", ""},
	{"metadata", "jsonb", ""},
	{"created_at", "timestamp with time zone", ""},
	{"available_at", "timestamp with time zone", ""},
	{"deliveries", "integer", ""},
	{"lease_token", "uuid", ""},
	{"leased_until", "timestamp with time zone", ""},
	{"leased_by", "text", ""},
	{"dedup_key", "text", ""},
	{"last_error", "text", ""},
	{"lease_holder", "bigint", ""},
	{"failure_reason", "text", ""},
	{"ordering_key", "text", ""},
}

// GenerationColumn is a rotating outbox's partition key (see Names.Rotated).
var GenerationColumn = Column{"generation", "smallint", ""}

// groupColumn is the consumer group a row is for; ” is the default group
// (subscribers without a ConsumerGroup). A constant default makes adding it
// to a full table a catalog change, not a rewrite.
var groupColumn = Column{"consumer_group", "text", "text NOT NULL DEFAULT ''"}

// AddedColumns are the outbox columns added after the first release: DDL
// adds them to a table created before, so applying the script again
// upgrades it.
var AddedColumns = []Column{
	{"lease_holder", "bigint", ""},
	{"failure_reason", "text", ""},
	groupColumn,
	{"ordering_key", "text", ""},
}

// AddedDLQColumns are the same for the dead-letter table.
var AddedDLQColumns = []Column{groupColumn, {"ordering_key", "text", ""}}

// BindingsColumns are the columns of the bindings table.
var BindingsColumns = []Column{
	{"topic", "text", ""},
	{"consumer_group", "text", ""},
	{"bound_at", "timestamp with time zone", ""},
	{"backlog_next", "bigint", ""},
	{"backlog_bound", "bigint", ""},
	{"backlog_end", "bigint", ""},
}

// AddedBindingsColumns are the bindings columns added after the release
// that introduced the table: the cursor of a new group's backlog copy
// (NULL when there is none to do; see CopyBacklog). Publishers never read
// them.
var AddedBindingsColumns = []Column{
	{"backlog_next", "bigint", ""},
	{"backlog_bound", "bigint", ""},
	{"backlog_end", "bigint", ""},
}

// DLQColumns are the columns of the dead-letter table.
var DLQColumns = []Column{
	{"id", "bigint", ""},
	{"topic", "text", ""},
	{"consumer_group", "text", ""},
	{"uuid", "text", ""},
	{"payload", "bytea", ""},
	{"metadata", "jsonb", ""},
	{"created_at", "timestamp with time zone", ""},
	{"deliveries", "integer", ""},
	{"dedup_key", "text", ""},
	{"last_error", "text", ""},
	{"failure_reason", "text", ""},
	{"failed_by", "text", ""},
	{"failed_at", "timestamp with time zone", ""},
	{"ordering_key", "text", ""},
}

// Index is an index the code relies on.
type Index struct {
	Table  string // unquoted table name
	Name   string // unquoted index name
	Unique bool
	// Keys is its columns and predicate as CREATE INDEX takes them:
	// what the claims' plans and the conflict targets rely on.
	Keys string
}

// Indexes lists the indexes of the outbox (and dead-letter table, if any).
func (n Names) Indexes() []Index {
	idx := []Index{n.index(n.ReadyIdx), n.index(n.LeaseIdx), n.index(n.DedupIdx), n.index(n.OrderIdx), n.index(n.OrderLeaseIdx)}
	if n.DLQTable != "" {
		idx = append(idx, n.index(n.DLQIdx))
	}
	if n.Arrivals {
		idx = append(idx, n.index(n.ArrivalsPkey()))
	}
	return idx
}

// index is the definition of n's index name.
func (n Names) index(name string) Index {
	switch name {
	case n.ReadyIdx:
		// Ready rows of a topic and group, in delivery order; the claim's
		// "ready" branch scans it.
		return Index{Table: n.Table, Name: name, Keys: "(topic, consumer_group, available_at, id) WHERE lease_token IS NULL"}
	case n.LeaseIdx:
		// Leased rows by expiry; the claim's "expired" branch scans it.
		return Index{Table: n.Table, Name: name, Keys: "(topic, consumer_group, leased_until) WHERE lease_token IS NOT NULL"}
	case n.DedupIdx:
		// Timer / idempotency keys: unique per topic and group while the
		// row exists (every group gets its own copy of a keyed message).
		return Index{Table: n.Table, Name: name, Unique: true, Keys: n.dedupConflict()}
	case n.OrderIdx:
		// Ordering keys: a keyed row is claimable only while no older row
		// of its key is present; the claim probes this index for one.
		return Index{Table: n.Table, Name: name, Keys: "(topic, consumer_group, ordering_key, id) WHERE ordering_key IS NOT NULL"}
	case n.OrderLeaseIdx:
		// Keys with a leased row: whatever its id (a row committed late, a
		// requeued dead letter), no other row of the key may be claimed
		// meanwhile. Small: leased keyed rows only.
		return Index{Table: n.Table, Name: name, Keys: "(topic, consumer_group, ordering_key) WHERE ordering_key IS NOT NULL AND lease_token IS NOT NULL"}
	case n.DLQIdx:
		return Index{Table: n.DLQTable, Name: name, Keys: "(topic, failed_at)"}
	case n.ArrivalsPkey():
		// Made with the arrivals table (arrivalsDDL), as its primary key.
		return Index{Table: n.ArrivalsTable, Name: name, Unique: true, Keys: "(topic, id)"}
	}
	panic("pgoutbox: no index " + name)
}

// qualified is table of n's schema, quoted.
func (n Names) qualified(table string) string { return n.QSchema + "." + Quote(table) }

// createIndex builds idx where it is missing (see ifNoIndex).
func createIndex(n Names, idx Index) string {
	unique := ""
	if idx.Unique {
		unique = "UNIQUE "
	}
	return ifNoIndex(n, idx.Name, fmt.Sprintf(`CREATE %sINDEX IF NOT EXISTS %s ON %s %s`,
		unique, Quote(idx.Name), n.qualified(idx.Table), idx.Keys))
}

// SameIndex tells whether an index whose definition the server prints as
// def (pg_get_indexdef, from its access method on: CatalogIndexes) is
// idx: the same method, columns and predicate, whatever the parentheses
// and spacing the server adds.
//
// An index whose key columns go on past idx's with columns the outbox's
// DDL does not have counts as idx too: a table partitioned by a column of
// its owner's must hold it in every unique index, as the rotating outbox
// holds its generation.
func SameIndex(idx Index, unique bool, def string) bool {
	norm := func(s string) string {
		return strings.Map(func(r rune) rune {
			if r == '(' || r == ')' || unicode.IsSpace(r) {
				return -1
			}
			return unicode.ToLower(r)
		}, s)
	}
	if unique != idx.Unique {
		return false
	}
	have, want := norm(def), norm("btree "+idx.Keys)
	if have == want {
		return true
	}
	// "btree" + columns, then "where..." if any.
	split := func(s string) (cols, rest string) {
		if i := strings.Index(s, "where"); i >= 0 {
			return s[:i], s[i:]
		}
		return s, ""
	}
	haveCols, haveRest := split(have)
	wantCols, wantRest := split(want)
	extra, ok := strings.CutPrefix(haveCols, wantCols+",")
	if !ok || haveRest != wantRest {
		return false
	}
	for _, c := range strings.Split(extra, ",") {
		if ownColumn(c) {
			return false
		}
	}
	return true
}

// ownColumn reports whether c is a column of the outbox's DDL.
func ownColumn(c string) bool {
	if c == "id" || c == GenerationColumn.Name {
		return true
	}
	for _, col := range OutboxColumns {
		if col.Name == c {
			return true
		}
	}
	return false
}

// CreateSchema creates the outbox's schema when it is missing. Not a bare
// CREATE SCHEMA IF NOT EXISTS: PostgreSQL checks the right to create
// schemas in the database before it looks whether the schema exists, so a
// migration role that owns the schema a DBA made for it, and may not
// create others, failed on its first statement.
func CreateSchema(n Names) string {
	return fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s) THEN
        CREATE SCHEMA IF NOT EXISTS %s;
    END IF;
END $pgoutbox$`, literal(n.Schema), n.QSchema)
}

// DDL returns the statements that create the outbox (and the dead-letter
// table when configured). Every statement is idempotent.
//
// Storage parameters: a queue table is mostly dead tuples (every claim and
// every ack leaves one), so autovacuum must visit it after 1% churn instead
// of the default 20%, or the claim's index scans wade through dead entries.
func DDL(n Names) []string {
	stmts := []string{}
	if n.Schema != "public" {
		stmts = append(stmts, CreateSchema(n))
	}
	if n.Rotating {
		stmts = append(stmts, rotatingTable(n))
	} else {
		stmts = append(stmts, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,%s
) WITH (%s)`, n.QTable, outboxColumnsDDL, queueStorage))
	}
	stmts = append(stmts, addColumns(n.QTable, AddedColumns)...)
	stmts = append(stmts,
		// Ready rows of a topic and group, in delivery order; the claim's
		// "ready" branch scans it.
		createIndex(n, n.index(n.ReadyIdx)),
		// Leased rows by expiry; the claim's "expired" branch scans it.
		createIndex(n, n.index(n.LeaseIdx)),
		// Timer / idempotency keys: unique per topic and group while the
		// row exists (every group gets its own copy of a keyed message).
		createIndex(n, n.index(n.DedupIdx)),
		// Ordering keys: a keyed row is claimable only while no older row
		// of its key is present; the claim probes this index for one.
		createIndex(n, n.index(n.OrderIdx)),
		// Keys with a leased row: whatever its id (a row committed late, a
		// requeued dead letter), no other row of the key may be claimed
		// meanwhile. Small: leased keyed rows only.
		createIndex(n, n.index(n.OrderLeaseIdx)),
	)
	// The first release's indexes, without the group: its unique dedup
	// index would refuse a keyed message's second group.
	for _, old := range n.OldIndexes {
		stmts = append(stmts, fmt.Sprintf(`DROP INDEX IF EXISTS %s.%s`, n.QSchema, Quote(old)))
	}
	// The bindings table. Created on an outbox that already holds rows (an
	// upgrade from the first release, whose subscribers have no group and
	// do not bind), it binds the groups of those rows (the default group)
	// to their topics: binding a new group to such a topic later must not
	// stop the copies its running consumers get.
	stmts = append(stmts, fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF to_regclass('%[1]s') IS NULL THEN
        CREATE TABLE %[1]s (
            topic          text        NOT NULL,
            consumer_group text        NOT NULL,
            bound_at       timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (topic, consumer_group)
        );
        INSERT INTO %[1]s (topic, consumer_group) SELECT DISTINCT topic, consumer_group FROM %[2]s;
    END IF;
END $pgoutbox$`, n.QBindings, n.QTable))
	stmts = append(stmts, pausedDDL(n))
	stmts = append(stmts, addColumns(n.QBindings, AddedBindingsColumns)...)
	if !n.Rotating {
		// Every single-table outbox has its arrivals table (version 7),
		// empty while no publisher sets Arrivals: turning Arrivals on is
		// then a setting, not a schema change.
		stmts = append(stmts, arrivalsDDL(n.WithArrivals())...)
	}
	if n.DLQTable != "" {
		stmts = append(stmts,
			fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    id             bigint      PRIMARY KEY,
    topic          text        NOT NULL,
    consumer_group text        NOT NULL DEFAULT '',
    uuid           text        NOT NULL,
    payload        bytea       NOT NULL,
    metadata       jsonb       NOT NULL,
    created_at     timestamptz NOT NULL,
    deliveries     integer     NOT NULL,
    dedup_key      text,
    last_error     text,
    failure_reason text        NOT NULL,
    failed_by      text,
    failed_at      timestamptz NOT NULL DEFAULT now(),
    ordering_key   text
)`, n.QDLQ),
		)
		stmts = append(stmts, addColumns(n.QDLQ, AddedDLQColumns)...)
		stmts = append(stmts,
			createIndex(n, n.index(n.DLQIdx)))
	}
	return stmts
}

// outboxColumnsDDL declares the outbox's columns after id.
const outboxColumnsDDL = `
    topic        text        NOT NULL,
    consumer_group text      NOT NULL DEFAULT '',
    uuid         text        NOT NULL,
    payload      bytea       NOT NULL,
    metadata     jsonb       NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    deliveries   integer     NOT NULL DEFAULT 0,
    lease_token  uuid,
    leased_until timestamptz,
    leased_by    text,
    dedup_key    text,
    last_error   text,
    lease_holder bigint,
    failure_reason text,
    ordering_key text`

// queueStorage are the outbox's storage parameters (see DDL).
const queueStorage = `
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
`

// rotatingTable creates a rotating outbox (see Names.Rotated): its
// generation sequence, the partitioned table and its partitions, whose
// storage parameters are the single table's (a partitioned table has
// none). It refuses a single table of the same name: turning one into a
// rotating outbox is ConvertToRotating's job (see Conversion).
func rotatingTable(n Names) string {
	parts := ""
	for g := range n.Generations {
		// The ring's partitions refuse keyed rows: the dedup index keeps
		// keys unique within a partition only, so a keyed row written
		// into the ring (by a process that does not know the outbox
		// rotates) would make its key deliverable twice.
		unkeyed := ""
		if g != LongGeneration {
			unkeyed = fmt.Sprintf(" (CONSTRAINT %s CHECK (dedup_key IS NULL))", Quote(derive(n.Generations[g], "_unkeyed")))
		}
		// A partition that exists is left alone: converting a single
		// table makes that table the long partition, attached afterwards.
		parts += fmt.Sprintf(`
        IF to_regclass('%[1]s') IS NULL THEN
            CREATE TABLE %[1]s PARTITION OF %[2]s%[5]s FOR VALUES IN (%[3]d) WITH (%[4]s);
        END IF;`, n.QGeneration(g), n.QTable, g, queueStorage, unkeyed)
	}
	// The partitions after the table, each made where it is missing: a
	// partition dropped by hand is made again (empty) by schema.Create.
	return fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF to_regclass('%[1]s') IS NULL THEN
        CREATE SEQUENCE %[2]s MINVALUE 0 START 0;
        PERFORM setval('%[2]s', %[6]s, true); -- generation 0, current from now (see Names.seqAt)
        CREATE TABLE %[1]s (
    id           bigint      GENERATED ALWAYS AS IDENTITY,%[3]s,
    generation   smallint    NOT NULL DEFAULT %[4]s,
    PRIMARY KEY (id, generation)
        ) PARTITION BY LIST (generation);
        ALTER SEQUENCE %[2]s OWNED BY %[1]s.generation;
    ELSIF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute WHERE attrelid = '%[1]s'::regclass AND attname = 'generation' AND NOT attisdropped) THEN
        RAISE EXCEPTION 'pgoutbox: %[1]s is a single table, not a rotating outbox; convert it with schema.ConvertToRotating (pgoutbox schema convert-to-rotating), or leave Rotating unset';
    END IF;%[5]s
END $pgoutbox$`, n.QTable, n.QGenSeq, outboxColumnsDDL, n.currentGeneration(), parts, n.seqAt("clock_timestamp()", "0"))
}

// addColumns adds columns to a table created by an earlier release, each
// only when it is missing: ALTER TABLE takes an exclusive lock on the
// queue even when the column exists.
func addColumns(qtable string, cols []Column) []string {
	var out []string
	for _, c := range cols {
		decl := c.Decl
		if decl == "" {
			decl = c.Type
		}
		out = append(out, fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                    WHERE attrelid = '%[1]s'::regclass AND attname = '%[2]s' AND NOT attisdropped) THEN
        ALTER TABLE %[1]s ADD COLUMN %[2]s %[3]s;
    END IF;
END $pgoutbox$`, qtable, c.Name, decl))
	}
	return out
}

// ifNoIndex runs a CREATE INDEX only when the index is missing: CREATE
// INDEX IF NOT EXISTS takes a SHARE lock on the table before it looks.
func ifNoIndex(n Names, name, stmt string) string {
	return fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF to_regclass('%s.%s') IS NULL THEN
        %s;
    END IF;
END $pgoutbox$`, n.QSchema, Quote(name), stmt)
}

// Script joins DDL into one text for migration tools.
func Script(n Names) string {
	return strings.Join(DDL(n), ";\n\n") + ";\n"
}

// CreateLock serialises concurrent Create calls for the same outbox: CREATE
// ... IF NOT EXISTS is not safe against a concurrent creator of the same name.
const CreateLock = `SELECT pg_advisory_xact_lock(hashtext($1))`

// CatalogColumns lists the columns of one table: name and format_type.
const CatalogColumns = `
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped`

// CatalogRotating tells whether a table ($1 schema, $2 name) is a
// rotating outbox: partitioned by its generation column. (An outbox a user
// partitioned otherwise is a single-table outbox to pgoutbox.)
const CatalogRotating = `
SELECT CASE WHEN c.relkind = 'p' AND EXISTS (
           SELECT FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'generation' AND NOT a.attisdropped)
       THEN 'rotating' ELSE 'table' END
  FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = $1 AND c.relname = $2`

// CatalogRelations describes the relations of schema $1 among the names
// $2 that exist: the name, whether it has an outbox's lease_token column
// ('true' or 'false'), and the table it is a partition of (” when none).
const CatalogRelations = `
SELECT c.relname::text,
       EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'lease_token' AND NOT a.attisdropped)::text,
       coalesce((SELECT pn.nspname || '.' || p.relname FROM pg_inherits i
                   JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace pn ON pn.oid = p.relnamespace
                  WHERE i.inhrelid = c.oid AND c.relispartition), '')
  FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = $1 AND c.relname = ANY ($2::text[])`

// CatalogPartitions lists the partitions of table $1 (quoted, qualified).
const CatalogPartitions = `SELECT c.relname::text FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass($1::text)`

// CatalogIndexes lists the index names of one table, each with whether
// it is valid (a CREATE INDEX CONCURRENTLY that failed or was cancelled
// leaves an invalid index under its name, which the planner does not use
// and IF NOT EXISTS takes for built), whether it is unique, and its
// definition from its access method on (SameIndex).
// The definition is what ATTACH PARTITION compares (indexShape), or ""
// for an index a concurrent DROP INDEX took away as the statement ran.
var CatalogIndexes = `
SELECT ic.relname, i.indisvalid::text, i.indisunique::text, coalesce(` + indexShape("i") + `, '')
  FROM pg_index i
  JOIN pg_class ic ON ic.oid = i.indexrelid
  JOIN pg_class c ON c.oid = i.indrelid
  JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = $1 AND c.relname = $2`
