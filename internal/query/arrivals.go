package query

import "fmt"

// Arrivals (schema.Config.Arrivals): a plain message (due now, no dedup or
// ordering key) arrives in a table of its own, which holds what a message
// is and nothing else: no consumer group, no delivery state, one index.
// Publishing one is an INSERT into a narrow table with one index entry and
// no lookup of the topic's bindings (tests/bench -publish-cost: the
// outbox's second index and the lookup are what separate a Publish from
// watermill-sql's). The subscribers give an arrival its group and its
// delivery state when they take it:
//
//   - A binding records the arrival id from which its group receives
//     (arrivals_from): 0 for the first groups of a topic (they take what
//     arrived before them, as first binders adopt unbound rows), the next
//     value of the id sequence for a later group, taken before its binding
//     commits, so a publish that starts after the commit always gets a
//     higher id. An arrival belongs to every group bound at or below its
//     id: what the lookup decides at publish time in the outbox.
//   - While a group is the only one bound to a topic, its arrivals are
//     taken where they are: a held claim locks them and its batch's end
//     deletes them; a lease claim moves them into the outbox as leases
//     under their ids (arrivals take their ids from the outbox's identity,
//     so ids never collide).
//   - While several groups are bound, the subscriber that meets arrivals
//     first fans them out (Transfer): one outbox row per group, due at the
//     arrival, as a publish would have written, and the claims take them
//     from the outbox. All of them, those that belong to one group too: a
//     group then takes every message from one table, in one order.
//
// Every other message, and every row once it is leased, nacked or dead,
// lives in the outbox as before.

// WithArrivals returns n with its arrivals table.
func (n Names) WithArrivals() Names {
	n.Arrivals = true
	n.ArrivalsTable = derive(n.Table, "_arrivals")
	n.QArrivals = n.QSchema + "." + Quote(n.ArrivalsTable)
	return n
}

// ArrivalsPkey is the name of the arrivals table's primary key.
func (n Names) ArrivalsPkey() string { return derive(n.ArrivalsTable, "_pkey") }

// ArrivalsColumns are the columns of the arrivals table.
var ArrivalsColumns = []Column{
	{"id", "bigint", ""},
	{"topic", "text", ""},
	{"uuid", "text", ""},
	{"payload", "bytea", ""},
	{"metadata", "jsonb", ""},
	{"created_at", "timestamp with time zone", ""},
}

// ArrivalsFromColumn is the bindings column an outbox with arrivals adds:
// the arrival id from which the binding's group receives.
var ArrivalsFromColumn = Column{"arrivals_from", "bigint", "bigint NOT NULL DEFAULT 0"}

// arrivalsDDL creates the arrivals table: its ids come from the outbox's
// identity sequence (looked up once, here), and its one index, the primary
// key (topic, id), finds a topic's arrivals in the order they arrived.
func arrivalsDDL(n Names) []string {
	stmts := []string{
		fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF to_regclass('%[1]s') IS NULL THEN
        EXECUTE format('CREATE TABLE %[1]s (
    id         bigint      NOT NULL DEFAULT nextval(%%L::regclass),
    topic      text        NOT NULL,
    uuid       text        NOT NULL,
    payload    bytea       NOT NULL,
    metadata   jsonb       NOT NULL DEFAULT ''{}'',
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT %[2]s PRIMARY KEY (topic, id)
) WITH (%[3]s)', pg_get_serial_sequence('%[4]s', 'id'));
    END IF;
END $pgoutbox$`, n.QArrivals, Quote(n.ArrivalsPkey()), queueStorage, n.QTable),
	}
	// Through the catalog: ALTER TABLE ... ADD COLUMN IF NOT EXISTS takes
	// the bindings' ACCESS EXCLUSIVE lock even when the column is there,
	// and every Create runs this.
	return append(stmts, addColumns(n.QBindings, []Column{ArrivalsFromColumn})...)
}

// ArrivalsDDL creates the arrivals table of n's single table (and the
// bindings column) when missing: a single table made from a rotating one
// gets it (ConvertToSingle).
func ArrivalsDDL(n Names) []string { return arrivalsDDL(n.WithArrivals()) }

// arrivalsPublish are the plain publish statements of an outbox with
// arrivals: the Publisher's Plain and One statements, without the lookup.
func arrivalsPublish(n Names, p PublishStatements) PublishStatements {
	plain := fmt.Sprintf(`
    INSERT INTO %s (topic, uuid, payload, metadata)
    SELECT $1, m.uuid, m.payload, m.metadata::jsonb
      FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata)`, n.QArrivals)
	one := fmt.Sprintf(`
    INSERT INTO %s (topic, uuid, payload, metadata) VALUES ($1, $2, $3, $4::jsonb)`, n.QArrivals)
	notify := `
WITH ins AS (%s
    RETURNING 1
)
SELECT pg_notify($5, chr(28) || $1) WHERE EXISTS (SELECT 1 FROM ins)` // ArrivalMark
	p.PublishPlain, p.PublishPlainQuiet = fmt.Sprintf(notify, plain), plain
	p.PublishOne, p.PublishOneQuiet = fmt.Sprintf(notify, one), one
	return p
}

// arrivalsBounds is the range of a topic's ($1) arrival ids a claim of
// group g takes where they are: from the group's start while it is the
// topic's only binding; nothing when it is not bound (lo NULL) or another
// group is (hi, the lowest start of the others: the arrivals from there
// on are fanned out, and the claim leaves the rest to the fan-out too).
func arrivalsBounds(n Names, g string) string {
	return fmt.Sprintf(`arrivals_bounds AS (
    SELECT (SELECT arrivals_from FROM %[1]s WHERE topic = $1 AND consumer_group = %[2]s) AS lo,
           (SELECT min(arrivals_from) FROM %[1]s WHERE topic = $1 AND consumer_group <> %[2]s) AS hi
)`, n.QBindings, g)
}

// arrivalsPick selects (cols of) up to limit arrivals of topic $1 that
// belong to group g alone, after the arrivals cursor, locking them, in the
// primary key's order.
func arrivalsPick(n Names, g, cursor, limit, cols string) string {
	return fmt.Sprintf(`arrivals_pick AS (
    SELECT %[5]s FROM %[1]s a
     WHERE a.topic = $1 AND a.id > %[3]s
       AND a.id >= (SELECT lo FROM arrivals_bounds) AND (SELECT hi FROM arrivals_bounds) IS NULL`+NotPaused(n.QTable, g)+`
     ORDER BY a.id
     LIMIT %[4]s
       FOR UPDATE SKIP LOCKED
)`, n.QArrivals, g, cursor, limit, cols)
}

// arrivalsShared is an expression telling whether topic $1, bound to
// several groups, has arrivals to fan out (Transfer).
func arrivalsShared(n Names) string {
	return fmt.Sprintf(`((SELECT hi FROM arrivals_bounds) IS NOT NULL AND EXISTS (SELECT 1 FROM %s s WHERE s.topic = $1
              AND s.id >= least((SELECT lo FROM arrivals_bounds), (SELECT hi FROM arrivals_bounds))))`, n.QArrivals)
}

// arrivalsLeaseBranch is what a lease claim of an outbox with arrivals
// adds after its ready rows: the arrivals of its group alone, up to the
// rows left (limit), moved into the outbox as leases under the claim's
// token, keeping their ids, unless the claim is late (onTime, see
// inTime). Its CTEs follow the claim's, comma first.
func arrivalsLeaseBranch(n Names, cursor, limit, onTime string) string {
	return fmt.Sprintf(`
), %[1]s, %[2]s, arrived AS (
    DELETE FROM %[3]s a WHERE a.topic = $1 AND a.id = ANY (ARRAY(SELECT id FROM arrivals_pick))%[5]s
    RETURNING a.id, a.uuid, a.payload, a.metadata, a.created_at
), moved AS (%[4]s
    RETURNING id, uuid, payload, metadata, deliveries, available_at, ordering_key, created_at`,
		arrivalsBounds(n, "$10"), arrivalsPick(n, "$10", cursor, limit, "a.id"), n.QArrivals,
		arrivalsAsLeases(n, "arrived", leaseParams{"$1", "$10", "$3", "now() + $4", "$5", "$9"}), onTime)
}

// leaseParams are the expressions of a lease written by arrivalsAsLeases:
// the topic, the group, the token, the end's start plus the lease in
// microseconds, the worker and the liveness key.
type leaseParams struct{ topic, group, token, ends, worker, holder string }

// arrivalsAsLeases inserts the arrivals of src (id, uuid, payload,
// metadata, created_at) into the outbox as leases (p), keeping their ids:
// their first delivery, due at their arrival.
func arrivalsAsLeases(n Names, src string, p leaseParams) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (id, topic, consumer_group, uuid, payload, metadata, created_at, available_at,
                       deliveries, lease_token, leased_until, leased_by, lease_holder)
    OVERRIDING SYSTEM VALUE
    SELECT m.id, %[3]s, %[4]s, m.uuid, m.payload, m.metadata, m.created_at, m.created_at,
           1, %[5]s::uuid, %[6]s::bigint * interval '1 microsecond', %[7]s, %[8]s::bigint
      FROM %[2]s m`, n.QTable, src, p.topic, p.group, p.token, p.ends, p.worker, p.holder)
}

// arrivalsHeld is the held claim of an outbox with arrivals: the outbox's
// held claim ($1 topic, $2 rows, $3 group, $4 and $5 its cursor), then the
// arrivals of the group alone after $6, locked where they are, for the
// rows left. An arrival's row ends with its ctid (NULL for an outbox row):
// the lock keeps the tuple where it is until the transaction ends, so the
// batch's end finds it there without an index (HeldAck: half the time of
// a probe of the primary key). A last row of NULLs says whether arrivals
// wait to be fanned out (Transfer).
func arrivalsHeld(n Names, outboxHeld string) string {
	return fmt.Sprintf(`
WITH held AS (%[1]s
), %[2]s, %[3]s
SELECT h.*, NULL::tid, NULL::bool FROM held h
UNION ALL
SELECT a.*, NULL::bool FROM arrivals_pick a
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, %[4]s`,
		outboxHeld, arrivalsBounds(n, "$3"),
		arrivalsPick(n, "$3", "$6", "$2::int - (SELECT count(*) FROM held)",
			"a.id, a.uuid, a.payload, a.metadata, 1, a.created_at, NULL::text, a.created_at, a.ctid"),
		arrivalsShared(n))
}

// ArrivalsStatements are the statements of an outbox with arrivals beyond
// the publish and claim statements (which Build adapts).
type ArrivalsStatements struct {
	// HeldAck deletes the acked arrivals of a held batch in its
	// transaction, by their ctids ($1, see arrivalsHeld): the locks make
	// a token unnecessary and keep each where the claim found it. An
	// arrival that another group bound meanwhile with StartFromBacklog
	// (topic $2; the batch's group is $3) was not the batch's alone any
	// more: it gets its copy, and a wake-up ($4: the channel).
	HeldAck string
	// HeldFinish is HeldAck plus the arrivals of the batch that leave it
	// without an ack ($5): they move into the outbox as leases of group $3
	// under token $6 (see HeldFinish), keeping their ids.
	HeldFinish string
	// Transfer fans out up to $3 arrivals of topic $1 while groups other
	// than $2 are bound to it too: one outbox row per group each belongs
	// to, due at its arrival, and a wake-up for each group ($4: the
	// channel). It returns the arrivals moved. One runs at a time per
	// topic, the others do nothing: fan-outs that ran side by side would
	// commit their copies out of the arrivals' order, and an ordered
	// subscription would take a later copy before an earlier one.
	Transfer string
	// TransferLock tries the topic's fan-out lock (topic $1) for the
	// Transfer that follows it in the same transaction, and records
	// whether it got it. The lock comes in a statement of its own: a
	// statement reads the bindings as of its start, and one that waited
	// for the lock, or found it free just after an Unbind released it,
	// would fan out to the binding that Unbind removed.
	TransferLock string
}

func buildArrivals(n Names) ArrivalsStatements {
	if !n.Arrivals {
		return ArrivalsStatements{}
	}
	return ArrivalsStatements{
		HeldAck: fmt.Sprintf(`
WITH %[1]s)%[2]s`, arrivalsAcked(n), arrivalsLateCopies(n)),
		HeldFinish: fmt.Sprintf(`
WITH %[4]s
), moving AS (
    DELETE FROM %[1]s WHERE ctid = ANY ($5::tid[])
    RETURNING id, uuid, payload, metadata, created_at
), leases AS (%[2]s
    RETURNING 1
)%[3]s`, n.QArrivals, arrivalsAsLeases(n, "moving", leaseParams{"$2", "$3", "$6", "statement_timestamp() + $7", "$8", "$9"}),
			arrivalsLateCopies(n, "moving"), arrivalsAcked(n)),
		TransferLock: fmt.Sprintf(`SELECT set_config('%s', pg_try_advisory_xact_lock(%s)::text, true)`, transferLocked, fanOutKey(n)),
		Transfer: arrivalsFanOut(n, "%.0scurrent_setting('"+transferLocked+"', true) = 'true'",
			"id >= (SELECT min(arrivals_from) FROM bound WHERE EXISTS (SELECT 1 FROM bound WHERE consumer_group <> $2))",
			"b.arrivals_from <= m.id", "$3", "$4"),
	}
}

// arrivalsAcked are the CTEs (without the last parenthesis) that delete
// the acked arrivals of a held batch by their ctids ($1): read back
// (gone) only when another group is bound (bound_since), for their late
// copies.
func arrivalsAcked(n Names) string {
	return fmt.Sprintf(`%[2]s, gone AS (
    DELETE FROM %[1]s WHERE ctid = ANY ($1::tid[]) AND (SELECT later FROM bound_since)
    RETURNING id, uuid, payload, metadata, created_at
), deleted AS (
    DELETE FROM %[1]s WHERE ctid = ANY ($1::tid[]) AND NOT (SELECT later FROM bound_since)`, n.QArrivals, arrivalsBoundSince(n))
}

// arrivalsBoundSince tells a held batch's end (topic $2, group $3) whether
// another group is bound to the topic while the batch's own still is:
// only then may its arrivals need copies (arrivalsLateCopies), and only
// then does it read them back as it deletes them. A group renamed while
// the batch held them (RenameGroup) shows as another group, and is the
// same one: what it must get moves under its new name instead.
func arrivalsBoundSince(n Names) string {
	return fmt.Sprintf(`bound_since AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM %[1]s WHERE topic = $2 AND consumer_group <> $3)
       AND EXISTS (SELECT 1 FROM %[1]s WHERE topic = $2 AND consumer_group = $3) AS later
)`, n.QBindings)
}

// arrivalsLateCopies ends a held batch's statement over the arrivals it
// took (gone, and the other CTEs named): each gets a copy for every group
// other than the batch's ($3) that belongs to it, of topic $2, with a
// wake-up ($4: the channel). Only a group bound with StartFromBacklog
// while the batch held them has one: the batch's claim took them as its
// group's alone, and the backlog copy reads the outbox.
func arrivalsLateCopies(n Names, more ...string) string {
	src := "SELECT * FROM gone"
	for _, m := range more {
		src += " UNION ALL SELECT * FROM " + m
	}
	return fmt.Sprintf(`, others AS MATERIALIZED (
    SELECT consumer_group, arrivals_from FROM %[2]s WHERE topic = $2 AND consumer_group <> $3
       AND EXISTS (SELECT 1 FROM %[2]s WHERE topic = $2 AND consumer_group = $3)
), copies AS (
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata, created_at, available_at)
    SELECT $2, b.consumer_group, m.uuid, m.payload, m.metadata, m.created_at, m.created_at
      FROM (%[3]s) m JOIN others b ON b.arrivals_from <= m.id
     ORDER BY m.id, b.consumer_group
    RETURNING consumer_group
)
SELECT pg_notify($4, chr(30) || $2 || chr(30) || g) FROM (SELECT DISTINCT consumer_group AS g FROM copies) c`, n.QTable, n.QBindings, src)
}

// arrivalsFanOut moves up to limit arrivals of topic $1 that pick selects
// (a condition on id, over bound: the topic's bindings) into the outbox,
// one row for each binding b that belongs (a condition on m.id and b),
// waking each group (channel). Each copy is due at its arrival, so it
// keeps its place in its group's queue. It holds the topic's fan-out lock
// (lock, a boolean expression over %s, the lock's key, holds it to its
// transaction's end): fan-outs of a topic commit one after the other, in
// the arrivals' order.
func arrivalsFanOut(n Names, lock, pick, belongs, limit, channel string) string {
	key := fanOutKey(n)
	return fmt.Sprintf(`
WITH locked AS MATERIALIZED (
    SELECT %[4]s AS ok
), bound AS MATERIALIZED (
    SELECT consumer_group, arrivals_from FROM %[1]s WHERE topic = $1
), pick AS (
    SELECT id FROM %[2]s
     WHERE topic = $1 AND %[5]s AND (SELECT ok FROM locked)
     ORDER BY id
     LIMIT %[7]s
       FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM %[2]s a WHERE a.topic = $1 AND a.id = ANY (ARRAY(SELECT id FROM pick))
    RETURNING a.id, a.uuid, a.payload, a.metadata, a.created_at
), copies AS (
    INSERT INTO %[3]s (topic, consumer_group, uuid, payload, metadata, created_at, available_at)
    SELECT $1, b.consumer_group, m.uuid, m.payload, m.metadata, m.created_at, m.created_at
      FROM moved m JOIN bound b ON %[6]s
     ORDER BY m.id, b.consumer_group
    RETURNING consumer_group
), woken AS (
    SELECT pg_notify(%[8]s, chr(30) || $1 || chr(30) || g) FROM (SELECT DISTINCT consumer_group AS g FROM copies) c
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM woken)`, n.QBindings, n.QArrivals, n.QTable,
		fmt.Sprintf(lock, key), pick, belongs, limit, channel)
}

// fanOutKey is the key of the fan-out lock of topic $1.
func fanOutKey(n Names) string {
	return fmt.Sprintf(`hashtextextended('%s' || chr(30) || $1, 0)`, n.QArrivals)
}

// transferLocked is the setting in which TransferLock leaves, for the
// Transfer after it, whether it got the fan-out lock.
const transferLocked = "pgoutbox.transfer_locked"

// fanOutLock waits for the topic's fan-out lock (arrivalsFanOut);
// noFanOutLock takes none (its key is formatted away).
const (
	fanOutLock   = "(SELECT true FROM (SELECT pg_advisory_xact_lock(%s)) l)"
	noFanOutLock = "%.0strue"
)

// ArrivalsSettle fans out up to $3 arrivals of topic $1 that belong to
// group $2 (with every other group they belong to; $4: the channel), so
// that an Unbind or a MoveGroup of the group finds every message it has
// where a group's rows are. Run under the topic's lock (TopicLock), until
// it moves fewer than $3; it waits for a fan-out under way.
func ArrivalsSettle(n Names) string {
	return arrivalsFanOut(n, fanOutLock, "id >= (SELECT arrivals_from FROM bound WHERE consumer_group = $2)",
		"b.arrivals_from <= m.id", "$3", "$4")
}

// ArrivalsAdopt hands up to $2 arrivals of topic $1 that belong to no
// group (published while no binding covered their id: a publish in flight
// across the Unbind of the group it was for) to every group bound now,
// as the outbox's unbound rows are adopted by the next Bind ($3: the
// channel). It takes no fan-out lock (a Bind must not wait for a fan-out):
// its arrivals are older than any a fan-out takes, and their copies, due
// at their arrival, go before the fan-out's in every group's queue.
func ArrivalsAdopt(n Names) string {
	return arrivalsFanOut(n, noFanOutLock, "id < (SELECT min(arrivals_from) FROM bound)", "true", "$2", "$3")
}

// ArrivalsUnboundToDefault moves up to $2 arrivals of topic $1 that no
// binding covers (below every binding's arrivals_from, or all of them
// when the topic has none) into the outbox as rows of the default group,
// keeping their ids: where the outbox keeps a topic's unbound messages,
// for a MoveGroup from "" to hand them to a group. It returns the
// arrivals moved.
func ArrivalsUnboundToDefault(n Names) string {
	return fmt.Sprintf(`WITH pick AS (
    SELECT id FROM %[2]s
     WHERE topic = $1 AND id < coalesce((SELECT min(arrivals_from) FROM %[3]s WHERE topic = $1), 9223372036854775807)
     ORDER BY id
     LIMIT $2
       FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM %[2]s a WHERE a.topic = $1 AND a.id = ANY (ARRAY(SELECT id FROM pick))
    RETURNING a.id, a.uuid, a.payload, a.metadata, a.created_at
), ins AS (
    INSERT INTO %[1]s (id, topic, consumer_group, uuid, payload, metadata, created_at, available_at)
    OVERRIDING SYSTEM VALUE
    SELECT m.id, $1, '', m.uuid, m.payload, m.metadata, m.created_at, m.created_at FROM moved m
     ORDER BY m.id
    RETURNING 1
)
SELECT count(*) FROM ins`, n.QTable, n.QArrivals, n.QBindings)
}

// ArrivalsFrom is the arrivals_from of the groups a BindGroups statement
// ($1 topic, $3 backlog) binds: 0 when the topic has no binding yet (the
// first groups take what arrived before them) or the groups start from
// the backlog; else the id sequence's next value.
func ArrivalsFrom(n Names) string {
	return fmt.Sprintf(`(SELECT CASE WHEN $3::bool OR NOT EXISTS (SELECT 1 FROM %s WHERE topic = $1) THEN 0
             ELSE nextval(pg_get_serial_sequence('%s', 'id')) END)`, n.QBindings, n.QTable)
}

// ArrivalsOfNewGroups counts, after a BindGroups of groups $2 to topic
// $1, those of them that start at 0 (a topic's first groups,
// StartFromBacklog) and, if any does, the topic's arrivals: each such
// group takes every one of them (Bind's report; their copies are written
// when a subscriber fans them out).
func ArrivalsOfNewGroups(n Names) string {
	return fmt.Sprintf(`WITH g AS (
    SELECT count(*) AS groups FROM %[2]s WHERE topic = $1 AND consumer_group = ANY ($2) AND arrivals_from = 0
)
SELECT g.groups, CASE WHEN g.groups > 0 THEN (SELECT count(*) FROM %[1]s WHERE topic = $1) ELSE 0 END FROM g`, n.QArrivals, n.QBindings)
}

// ReadableTable tells whether table $1 (quoted, qualified) exists and the
// current role may read it.
const ReadableTable = `SELECT CASE WHEN to_regclass($1) IS NULL THEN false ELSE has_table_privilege($1, 'SELECT') END`

// ArrivalsIDDefault tells whether the arrivals table $1 takes its ids
// from the identity sequence of the outbox $2 (arrivalsBelong): a default
// drawn from another sequence would give arrivals ids the outbox has.
const ArrivalsIDDefault = `SELECT (` + arrivalsBelong + `)::text`

// ArrivalsStats counts the arrivals of every topic (or of topic $1) by the
// bound group they belong to (NULL: none yet), with the oldest's age in
// microseconds.
func ArrivalsStats(n Names, topic bool) string {
	cond := ""
	if topic {
		cond = " WHERE a.topic = $1"
	}
	// The age is by the clock as the statement runs, as Stats' own (a
	// Stats run in a long transaction would make now() the older time).
	return fmt.Sprintf(`SELECT a.topic, b.consumer_group, count(*), (extract(epoch FROM clock_timestamp() - min(a.created_at)) * 1000000)::bigint
  FROM %s a LEFT JOIN %s b ON b.topic = a.topic AND b.arrivals_from <= a.id%s
 GROUP BY 1, 2`, n.QArrivals, n.QBindings, cond)
}

// DropEmptyArrivals drops the arrivals table of n's single table when it
// holds nothing, under its lock (an arrival committed after the check
// would be lost), and fails naming it otherwise: a rotating outbox has no
// arrivals (ConvertToRotating), and a conversion back starts without one
// (ConvertToSingle: its id default would name the ring's sequence).
func DropEmptyArrivals(n Names) string {
	a := n.WithArrivals()
	return fmt.Sprintf(`DO $pgoutbox$ BEGIN
    IF to_regclass('%[1]s') IS NOT NULL THEN
        LOCK TABLE %[1]s IN ACCESS EXCLUSIVE MODE;
        IF EXISTS (SELECT 1 FROM %[1]s) THEN
            RAISE EXCEPTION '%% holds arrivals, which a rotating outbox has no place for; unset Arrivals in every publisher, let the subscribers (with Arrivals set) take what it holds, unset it in every subscriber, then convert', '%[1]s';
        END IF;
        DROP TABLE %[1]s;
    END IF;
END $pgoutbox$`, a.QArrivals)
}

// ArrivalsHeld tells whether n's arrivals table, which must exist, holds
// a row.
func ArrivalsHeld(n Names) string {
	return fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s)`, n.WithArrivals().QArrivals)
}

// ArrivalsUsable tells whether the arrivals table $1 exists and the role
// may take arrivals (SELECT and DELETE on it, USAGE on the sequence of the
// outbox $2's ids): every single-table outbox has the table, so its
// existence alone says nothing of whether its publishers use it, and a
// role granted only what an outbox without arrivals needs must not take
// the arrivals' paths (the CLI's setting of Arrivals).
const ArrivalsUsable = `SELECT CASE WHEN to_regclass($1) IS NULL THEN false
            ELSE has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'DELETE')
                 AND coalesce(has_sequence_privilege(pg_get_serial_sequence($2, 'id'), 'USAGE'), false)
                 AND ` + arrivalsBelong + ` END`

// arrivalsBelong tells whether the table named $1 takes its ids from the
// identity sequence of the outbox $2: whether it is that outbox's arrivals
// table, and not a table of another's that has its name (an outbox named
// "<table>_arrivals"). Through the catalog, not pg_get_serial_sequence,
// which the planner runs on constant arguments and which fails on a
// table that does not exist.
const arrivalsBelong = `EXISTS (
    SELECT 1 FROM pg_attrdef d
      JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum AND a.attname = 'id'
      JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid
                        AND dep.refclassid = 'pg_class'::regclass
      JOIN pg_depend seq ON seq.classid = 'pg_class'::regclass AND seq.objid = dep.refobjid
                        AND seq.refclassid = 'pg_class'::regclass AND seq.deptype IN ('i', 'a')
     WHERE d.adrelid = to_regclass($1) AND seq.refobjid = to_regclass($2))`

// ReadableArrivals tells whether $1 is the arrivals table of the outbox $2
// (arrivalsBelong) and the current role may read it.
const ReadableArrivals = `SELECT CASE WHEN to_regclass($1) IS NULL OR to_regclass($2) IS NULL THEN false
            ELSE has_table_privilege($1, 'SELECT') AND ` + arrivalsBelong + ` END`

// ForeignArrivals tells whether a table named as the arrivals table of the
// outbox $2 exists and is not its own ($1: ArrivalsTableOf).
const ForeignArrivals = `SELECT CASE WHEN to_regclass($1) IS NULL THEN false WHEN to_regclass($2) IS NULL THEN true
            ELSE NOT ` + arrivalsBelong + ` END`

// ArrivalsWaiting tells whether arrivals of topic $1 wait in the arrivals
// table of n, an outbox's names without its arrivals. A subscriber whose
// tables lack arrivals asks it before it starts (its claims never read
// them), once ReadableTable ($1: ArrivalsTableOf) found the table it may
// read: an outbox made before arrivals has none.
func ArrivalsWaiting(n Names) string {
	return `SELECT EXISTS (SELECT 1 FROM ` + n.WithArrivals().QArrivals + ` WHERE topic = $1)`
}

// ArrivalsTableOf is the qualified arrivals table of n, for ReadableTable.
func ArrivalsTableOf(n Names) string { return n.WithArrivals().QArrivals }
