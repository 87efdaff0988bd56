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
	return []string{
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
		fmt.Sprintf(`ALTER TABLE %s ADD COLUMN IF NOT EXISTS %s %s`, n.QBindings, ArrivalsFromColumn.Name, ArrivalsFromColumn.Decl),
	}
}

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
SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)`
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
// token, keeping their ids. Its CTEs follow the claim's, comma first.
func arrivalsLeaseBranch(n Names, cursor, limit string) string {
	return fmt.Sprintf(`
), %[1]s, %[2]s, arrived AS (
    DELETE FROM %[3]s a WHERE a.topic = $1 AND a.id = ANY (ARRAY(SELECT id FROM arrivals_pick))
    RETURNING a.id, a.uuid, a.payload, a.metadata, a.created_at
), moved AS (
    INSERT INTO %[4]s (id, topic, consumer_group, uuid, payload, metadata, created_at, available_at,
                       deliveries, lease_token, leased_until, leased_by, lease_holder)
    OVERRIDING SYSTEM VALUE
    SELECT a.id, $1, $10, a.uuid, a.payload, a.metadata, a.created_at, a.created_at,
           1, $3::uuid, now() + $4::bigint * interval '1 microsecond', $5, $9::bigint
      FROM arrived a
    RETURNING id, uuid, payload, metadata, deliveries, available_at, ordering_key, created_at`,
		arrivalsBounds(n, "$10"), arrivalsPick(n, "$10", cursor, limit, "a.id"), n.QArrivals, n.QTable)
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
	// a token unnecessary and keep each where the claim found it.
	HeldAck string
	// HeldFinish is HeldAck plus the arrivals of the batch that leave it
	// without an ack ($2): they move into the outbox as leases of topic $3
	// and group $4 under token $5 (see HeldFinish), keeping their ids.
	HeldFinish string
	// Transfer fans out up to $3 arrivals of topic $1 while groups other
	// than $2 are bound to it too: one outbox row per group each belongs
	// to, due at its arrival, and a wake-up for each group ($4: the
	// channel). It returns the arrivals moved.
	Transfer string
}

func buildArrivals(n Names) ArrivalsStatements {
	if !n.Arrivals {
		return ArrivalsStatements{}
	}
	return ArrivalsStatements{
		HeldAck: fmt.Sprintf(`DELETE FROM %s WHERE ctid = ANY ($1::tid[])`, n.QArrivals),
		HeldFinish: fmt.Sprintf(`
WITH acked AS (
    DELETE FROM %[1]s WHERE ctid = ANY ($1::tid[])
), moving AS (
    DELETE FROM %[1]s WHERE ctid = ANY ($2::tid[])
    RETURNING id, uuid, payload, metadata, created_at
)
INSERT INTO %[2]s (id, topic, consumer_group, uuid, payload, metadata, created_at, available_at,
                   deliveries, lease_token, leased_until, leased_by, lease_holder)
OVERRIDING SYSTEM VALUE
SELECT m.id, $3, $4, m.uuid, m.payload, m.metadata, m.created_at, m.created_at,
       1, $5::uuid, statement_timestamp() + $6::bigint * interval '1 microsecond', $7, $8::bigint
  FROM moving m`, n.QArrivals, n.QTable),
		Transfer: arrivalsTransfer(n, "(SELECT min(arrivals_from) FROM bound WHERE EXISTS (SELECT 1 FROM bound WHERE consumer_group <> $2))"),
	}
}

// arrivalsTransfer fans out up to $3 arrivals of topic $1 from id from on
// (an expression over bound, the topic's bindings; $2 is a group) to every
// group they belong to, waking each group ($4: the channel). Each copy is
// due at its arrival, so it keeps its place in its group's queue.
func arrivalsTransfer(n Names, from string) string {
	return fmt.Sprintf(`
WITH bound AS (
    SELECT consumer_group, arrivals_from FROM %[1]s WHERE topic = $1
), pick AS (
    SELECT id FROM %[2]s
     WHERE topic = $1 AND id >= %[4]s
     ORDER BY id
     LIMIT $3
       FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM %[2]s a WHERE a.topic = $1 AND a.id = ANY (ARRAY(SELECT id FROM pick))
    RETURNING a.id, a.uuid, a.payload, a.metadata, a.created_at
), copies AS (
    INSERT INTO %[3]s (topic, consumer_group, uuid, payload, metadata, created_at, available_at)
    SELECT $1, b.consumer_group, m.uuid, m.payload, m.metadata, m.created_at, m.created_at
      FROM moved m JOIN bound b ON b.arrivals_from <= m.id
     ORDER BY m.id, b.consumer_group
    RETURNING consumer_group
), woken AS (
    SELECT pg_notify($4, chr(30) || $1 || chr(30) || g) FROM (SELECT DISTINCT consumer_group AS g FROM copies) c
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM woken)`, n.QBindings, n.QArrivals, n.QTable, from)
}

// ArrivalsSettle fans out up to $3 arrivals of topic $1 that belong to
// group $2 (with every other group they belong to; $4: the channel), so
// that an Unbind or a MoveGroup of the group finds every message it has
// where a group's rows are. Run under the topic's lock (TopicLock), until
// it moves fewer than $3.
func ArrivalsSettle(n Names) string {
	return arrivalsTransfer(n, "(SELECT arrivals_from FROM bound WHERE consumer_group = $2)")
}

// ArrivalsFrom is the arrivals_from of the groups a BindGroups statement
// ($1 topic, $3 backlog) binds: 0 when the topic has no binding yet (the
// first groups take what arrived before them) or the groups start from
// the backlog; else the id sequence's next value.
func ArrivalsFrom(n Names) string {
	return fmt.Sprintf(`(SELECT CASE WHEN $3::bool OR NOT EXISTS (SELECT 1 FROM %s WHERE topic = $1) THEN 0
             ELSE nextval(pg_get_serial_sequence('%s', 'id')) END)`, n.QBindings, n.QTable)
}

// ArrivalsStats counts the arrivals of every topic (or of topic $1) by the
// bound group they belong to (NULL: none yet), with the oldest's age in
// microseconds.
func ArrivalsStats(n Names, topic bool) string {
	cond := ""
	if topic {
		cond = " WHERE a.topic = $1"
	}
	return fmt.Sprintf(`SELECT a.topic, b.consumer_group, count(*), (extract(epoch FROM now() - min(a.created_at)) * 1000000)::bigint
  FROM %s a LEFT JOIN %s b ON b.topic = a.topic AND b.arrivals_from <= a.id%s
 GROUP BY 1, 2`, n.QArrivals, n.QBindings, cond)
}
