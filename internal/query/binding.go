package query

import "fmt"

// Lists come back as JSON text, which every executor scans into a string
// (database/sql cannot scan an array).
//
// Consumer-group statements beyond the publish-time fan-out: binding with
// adoption of a topic's unbound rows, the backlog copy of a new group, and
// moving a group's rows into another. Built on demand, like the operator
// statements: they run once per Bind, never per message.
//
// Unbound rows: a message published while its topic has no binding is
// stored for the default group "" (publishGroups); while "" is not bound
// to the topic, such rows belong to no consumer yet, and the next Bind of
// the topic hands them to the groups then bound (AdoptUnbound). The
// publish statement is the first release's, so publishers of either
// release agree on where a message goes.

// TopicLock serialises the binds of one topic ($1: a key naming the
// bindings table and the topic): concurrent first binders then adopt one
// after the other, each seeing the other's binding. A transaction-level
// advisory lock on one bigint, which pg_locks shows with objsubid 1, apart
// from the liveness locks (objsubid 2).
//
// The wait ignores a role's or database's lock_timeout, which is put back
// for the rest of the transaction: binds of a topic take turns, and the
// Subscribes of a Router's handlers, starting together, waited for each
// other past a defensive 200 ms and failed (their bindings made anyway).
var TopicLock = pastLockTimeout(`pg_advisory_xact_lock(hashtextextended($1, 0))`)

// pastLockTimeout is a statement that takes lock (a call of
// pg_advisory_xact_lock) however long it waits, whatever lock_timeout
// says, and leaves the setting as it was for the rest of the transaction.
// The subquery's targets run in order: the setting is read, cleared, the
// lock taken; the outer set_config puts it back.
func pastLockTimeout(lock string) string {
	return `SELECT set_config('lock_timeout', l.was, true)
  FROM (SELECT current_setting('lock_timeout') AS was, set_config('lock_timeout', '0', true), ` + lock + `) l`
}

// SetLocalStatementTimeout bounds the statements of the rest of the
// transaction on the server ($1, e.g. '250ms'), which ends a statement and
// releases its locks at once, where a client that gives up only closes
// its connection and the statement runs on.
const SetLocalStatementTimeout = `SELECT set_config('statement_timeout', $1, true)`

// BindGroups binds the groups $2 to topic $1 and returns the groups whose
// binding is new. With $3 set, a new binding records the start of its
// backlog copy: backlog_next 0 (the copy's cursor) and backlog_bound, the
// highest row id when it was bound (rows above it may have been fanned out
// to the group already, see CopyBacklog). Only when another group is
// bound: a topic without one has no backlog, only unbound rows (adopted).
//
// With arrivals, a new binding also records where its group's arrivals
// start (ArrivalsFrom).
func BindGroups(n Names) string {
	arrCol, arrVal := "", ""
	if n.Arrivals {
		arrCol, arrVal = ", "+ArrivalsFromColumn.Name, ", "+ArrivalsFrom(n)
	}
	return fmt.Sprintf(`WITH c AS (
    SELECT $3::bool AND EXISTS (SELECT 1 FROM %[1]s WHERE topic = $1 AND consumer_group <> ALL ($2::text[])) AS copy
), new AS (
    INSERT INTO %[1]s (topic, consumer_group, backlog_next, backlog_bound%[3]s)
    SELECT $1, g, CASE WHEN (SELECT copy FROM c) THEN 0 END,
           CASE WHEN (SELECT copy FROM c) THEN (SELECT coalesce(max(id), 0) FROM %[2]s) END%[4]s
      FROM unnest($2::text[]) AS g
        ON CONFLICT DO NOTHING
    RETURNING consumer_group
)
SELECT coalesce(json_agg(consumer_group), '[]')::text FROM new`, n.QBindings, n.QTable, arrCol, arrVal)
}

// BindState tells, for topic $1: whether the default group is bound,
// whether unbound rows wait (rows of "" while "" is not bound: one probe of
// the ready index and one of the lease index), the groups of $2 whose
// backlog copy is unfinished, and how many groups are bound.
//
// Each probe is a scalar subquery ordered by its index: topic and group
// are correlated, and the planner, expecting many matches, planned EXISTS
// (which drops ORDER BY and LIMIT) as a sequential scan that read the whole
// table when there were none (0.5 to 4 s on 3,000,000 rows).
func BindState(n Names) string {
	return fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %[1]s WHERE topic = $1 AND consumer_group = ''),
       ((SELECT 1 FROM %[2]s WHERE topic = $1 AND consumer_group = '' AND lease_token IS NULL
          ORDER BY available_at, id LIMIT 1) IS NOT NULL
        OR (SELECT 1 FROM %[2]s WHERE topic = $1 AND consumer_group = '' AND lease_token IS NOT NULL
          ORDER BY leased_until LIMIT 1) IS NOT NULL),
       coalesce((SELECT json_agg(consumer_group) FROM %[1]s
                  WHERE topic = $1 AND consumer_group = ANY ($2::text[]) AND backlog_next IS NOT NULL), '[]')::text,
       (SELECT count(*) FROM %[1]s WHERE topic = $1)`,
		n.QBindings, n.QTable)
}

// Writers lists (as a JSON array) the transactions, other than this one,
// holding a write lock on the outbox ($1: its qualified name): every publish whose
// snapshot predates a binding just committed is among them (a statement
// locks its tables before it takes its snapshot).
const Writers = `SELECT coalesce(json_agg(virtualtransaction), '[]')::text FROM pg_catalog.pg_locks
 WHERE locktype = 'relation' AND relation = $1::regclass AND mode = 'RowExclusiveLock' AND granted
   AND pid <> pg_backend_pid()`

// WritersLeft counts the transactions of $1 (a JSON array of virtual
// transaction ids) still running: each holds the lock on its own virtual
// id until it ends.
const WritersLeft = `SELECT count(*) FROM pg_catalog.pg_locks
 WHERE locktype = 'virtualxid' AND granted
   AND virtualxid IN (SELECT jsonb_array_elements_text($1::jsonb))`

// AdoptUnbound moves up to $2 unbound rows of topic $1 (rows of "" while
// "" is not bound) into the groups bound to the topic, and wakes their
// subscribers ($3: the channel). The first group (by name) takes each row
// in place, keeping its id, so the per-key order of its rows holds; every
// other bound group gets a copy. Rows nobody holds are taken (unleased,
// or leased under a lease already expired); a row leased right now is
// being delivered to a default-group subscriber and stays. A row whose
// dedup key the first group holds already is left: moving it would break
// the key's uniqueness. Nothing happens while "" is bound or nothing is,
// nor while a group of the topic has a backlog copy to finish: its copy
// would take again, from the first group, the rows adopted behind its
// cursor; the copier adopts when it is done.
//
// Shape: the rows are found through the ready and lease indexes, led by
// (topic, consumer_group), each branch ordered by its index so that the
// planner scans it (see BindState), and the dedup-key probe repeats the
// dedup index's predicate so that, hashed or not, it reads only keyed rows
// (without it, a sequential scan of the group); the UPDATE finds its rows
// by primary key (id = ANY(ARRAY(...)), as the claim does). SKIP LOCKED
// never waits for a claimer. The caller holds TopicLock, so batches of
// concurrent binders do not interleave.
//
// With copies false, the statement has no INSERT (a subscriber role may
// lack the privilege) and moves rows only while exactly one group is
// bound; its third column is then the number of groups bound, so that the
// caller switches to the statement with copies when there are more, and
// 1 when no unbound row waits: binding a second group needs no INSERT
// unless there is something to copy.
func AdoptUnbound(n Names, copies bool) string {
	one, copiesCTE := " AND count(*) = 1", ""
	// Each probe ordered by its index, as the branches below: a bare
	// EXISTS may be planned as a sequential scan.
	// Rows of "" are the default group's own while "" is bound, and
	// nothing is adopted while a backlog copy runs: nothing to copy then.
	third := fmt.Sprintf(`CASE WHEN (SELECT NOT bool_or(consumer_group = '') AND NOT bool_or(backlog_next IS NOT NULL) FROM bound)
          AND ((SELECT 1 FROM %[1]s WHERE topic = $1 AND consumer_group = '' AND lease_token IS NULL
                ORDER BY available_at, id LIMIT 1) IS NOT NULL
              OR (SELECT 1 FROM %[1]s WHERE topic = $1 AND consumer_group = '' AND lease_token IS NOT NULL AND leased_until < now()
                ORDER BY leased_until LIMIT 1) IS NOT NULL)
         THEN (SELECT count(*) FROM bound) ELSE least((SELECT count(*) FROM bound), 1) END`, n.QTable)
	genCol, genVal := n.generationColumn("m.dedup_key")
	if copies {
		one, third = "", "(SELECT count(*) FROM copies)"
		copiesCTE = fmt.Sprintf(`), copies AS (
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata, created_at, available_at, deliveries,
                       dedup_key, last_error, failure_reason, ordering_key%[2]s)
    SELECT $1, b.consumer_group, m.uuid, m.payload, m.metadata, m.created_at, m.available_at, m.deliveries,
           m.dedup_key, m.last_error, m.failure_reason, m.ordering_key%[3]s
      FROM moved m CROSS JOIN bound b
     WHERE b.consumer_group <> (SELECT g FROM target)
     ORDER BY m.id, b.consumer_group
        ON CONFLICT %[4]s DO NOTHING
    RETURNING 1`, n.QTable, genCol, genVal, n.dedupConflict())
	}
	return fmt.Sprintf(`WITH bound AS (
    SELECT consumer_group, backlog_next FROM %[1]s WHERE topic = $1
), target AS (
    SELECT min(consumer_group) AS g FROM bound
     HAVING count(*) > 0 AND NOT bool_or(consumer_group = '') AND NOT bool_or(backlog_next IS NOT NULL)%[3]s
), unleased AS (
    SELECT id FROM %[2]s o
     WHERE topic = $1 AND consumer_group = '' AND lease_token IS NULL AND EXISTS (SELECT 1 FROM target)
       AND (o.dedup_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM %[2]s d WHERE d.topic = $1 AND d.consumer_group = (SELECT g FROM target)
               AND d.dedup_key = o.dedup_key AND d.dedup_key IS NOT NULL))
     ORDER BY available_at, id
     LIMIT $2 FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id FROM %[2]s o
     WHERE topic = $1 AND consumer_group = '' AND lease_token IS NOT NULL AND leased_until < now()
       AND EXISTS (SELECT 1 FROM target)
       AND (o.dedup_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM %[2]s d WHERE d.topic = $1 AND d.consumer_group = (SELECT g FROM target)
               AND d.dedup_key = o.dedup_key AND d.dedup_key IS NOT NULL))
     ORDER BY leased_until
     LIMIT (SELECT $2::int - count(*) FROM unleased) FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE %[2]s o
       SET consumer_group = (SELECT g FROM target),
           lease_token = NULL, leased_until = NULL, leased_by = NULL, lease_holder = NULL
     WHERE o.id = ANY (ARRAY(SELECT id FROM unleased UNION ALL SELECT id FROM expired))
    RETURNING o.id, o.uuid, o.payload, o.metadata, o.created_at, o.available_at, o.deliveries,
              o.dedup_key, o.last_error, o.failure_reason, o.ordering_key
%[4]s
), woken AS (
    SELECT pg_notify($3, $1) WHERE EXISTS (SELECT 1 FROM moved)
)
SELECT (SELECT count(*) FROM moved), %[5]s, (SELECT count(*) FROM woken)`, n.QBindings, n.QTable, one, copiesCTE, third)
}

// SetBacklogEnd fixes the end of the backlog copies of the groups $2 of
// topic $1 that have none yet: the highest row id now, once every publish
// that could not see their binding has ended (see Writers).
func SetBacklogEnd(n Names) string {
	return fmt.Sprintf(`UPDATE %[1]s SET backlog_end = (SELECT coalesce(max(id), 0) FROM %[2]s)
 WHERE topic = $1 AND consumer_group = ANY ($2::text[]) AND backlog_next IS NOT NULL AND backlog_end IS NULL`,
		n.QBindings, n.QTable)
}

// CopyBacklog copies one batch of the backlog of group $2 of topic $1: the
// messages waiting, when the copy reaches them, in the other groups bound
// to the topic, one copy per message (by UUID), in id order. $3 is the
// batch size (rows read), $4 the UUIDs the previous batch copied (JSON) (a
// message's rows of one fan-out lie side by side and may straddle two
// batches), $5 the channel to wake the group's subscribers on.
//
// The cursor lives in the binding (backlog_next, up to backlog_end), so a
// copy cut short resumes where it stopped; the batch and its cursor move
// commit together, and the binding row is locked for the statement, so
// two copiers of one group never copy a batch twice. Rows above
// backlog_bound were published around the binding: those whose message
// the group already has (by UUID, within that short id range) are
// skipped. Each batch is a primary-key range scan of $3 rows (the bounds
// are scalar subqueries so that they are index conditions: joined to b they
// were a filter over every id below the cursor), and its
// sources are read back by primary key (id = ANY(ARRAY(...))): with
// "id IN (SELECT ...)" the planner hash-joined a sequential scan of the
// outbox, 0.6 s a batch on 3,000,000 rows. The UUIDs the batch copied
// come from its sources as they are: joined back to the batch's rows, the
// join was a nested loop wherever the statistics say the outbox is nearly
// empty (a queue analyzed while drained), 5,000 rows compared with 5,000,
// seconds a batch (TestBacklogCopyWithTheStatisticsOfAnEmptyQueue).
//
// A copy is a fresh row for the group: delivery count 0, no error, due
// when its source was first due (a source already delivered or retried is
// due now). The last batch moves the cursor to backlog_end and leaves the
// binding's copy open: FinishBacklog ends it.
func CopyBacklog(n Names) string {
	genCol, genVal := n.generationColumn("o.dedup_key")
	return fmt.Sprintf(`WITH b AS (
    SELECT backlog_next AS next, backlog_end AS last, backlog_bound AS bound
      FROM %[1]s WHERE topic = $1 AND consumer_group = $2 AND backlog_next IS NOT NULL AND backlog_end IS NOT NULL
       FOR UPDATE
), win AS (
    SELECT o.id, o.uuid, o.consumer_group, o.available_at FROM %[2]s o
     WHERE o.id > (SELECT next FROM b) AND o.id <= (SELECT last FROM b) AND o.topic = $1
     ORDER BY o.id
     LIMIT $3
), src AS (
    SELECT DISTINCT ON (w.uuid) w.id, w.uuid FROM win w, b
     WHERE w.consumer_group <> $2 AND w.available_at < 'infinity'
       AND w.consumer_group IN (SELECT consumer_group FROM %[1]s WHERE topic = $1)
       AND w.uuid NOT IN (SELECT jsonb_array_elements_text($4::jsonb))
       AND (w.id <= b.bound OR NOT EXISTS (
            SELECT 1 FROM %[2]s t WHERE t.id > b.bound AND t.id <= b.last
               AND t.topic = $1 AND t.consumer_group = $2 AND t.uuid = w.uuid))
     ORDER BY w.uuid, w.id
), ins AS (
    INSERT INTO %[2]s (topic, consumer_group, uuid, payload, metadata, created_at, available_at, dedup_key, ordering_key%[3]s)
    SELECT $1, $2, o.uuid, o.payload, o.metadata, o.created_at,
           CASE WHEN o.deliveries > 0 OR o.lease_token IS NOT NULL THEN least(o.available_at, now())
                ELSE o.available_at END,
           o.dedup_key, o.ordering_key%[4]s
      FROM %[2]s o WHERE o.id = ANY (ARRAY(SELECT id FROM src))
     ORDER BY o.id
        ON CONFLICT %[5]s DO NOTHING
    RETURNING uuid
), adv AS (
    UPDATE %[1]s SET backlog_next = CASE WHEN (SELECT count(*) FROM win) < $3 THEN backlog_end ELSE (SELECT max(id) FROM win) END
     WHERE topic = $1 AND consumer_group = $2 AND EXISTS (SELECT 1 FROM b)
    RETURNING backlog_next
), woken AS (
    SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)
)
SELECT (SELECT count(*) FROM ins), EXISTS (SELECT 1 FROM adv) AND (SELECT count(*) FROM win) >= $3,
       coalesce((SELECT json_agg(uuid) FROM src), '[]')::text, (SELECT count(*) FROM woken)`, n.QBindings, n.QTable, genCol, genVal, n.dedupConflict())
}

// TopicHasBinding tells whether a group is bound to topic $1.
func TopicHasBinding(n Names) string {
	return fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE topic = $1)`, n.QBindings)
}

// FinishBacklog ends the backlog copy of group $2 of topic $1 once its
// cursor reached its end: it deletes the group's rows above backlog_bound
// whose UUID and publish time an older one of them has (copies keep their
// source's created_at; a message published anew under a UUID in use has
// its own), unleased (a message whose rows in
// the other groups lie far apart, copied by earlier copies or adoptions,
// was copied once per such row: the batches see only their own ids and
// the batch before), then clears the copy's columns. It returns how many
// rows it deleted. No subscriber of the group has claimed them: each
// Subscribe joins an unfinished copy before it claims.
func FinishBacklog(n Names) string {
	return fmt.Sprintf(`WITH b AS (
    SELECT backlog_bound AS bound FROM %[1]s
     WHERE topic = $1 AND consumer_group = $2 AND backlog_next IS NOT NULL AND backlog_next >= backlog_end
       FOR UPDATE
), dup AS (
    SELECT id FROM (SELECT o.id, row_number() OVER (PARTITION BY o.uuid, o.created_at ORDER BY o.id) AS n
                      FROM %[2]s o WHERE o.id > (SELECT bound FROM b) AND o.topic = $1 AND o.consumer_group = $2) x
     WHERE n > 1
), del AS (
    DELETE FROM %[2]s o WHERE o.id = ANY (ARRAY(SELECT id FROM dup)) AND o.lease_token IS NULL
    RETURNING 1
), fin AS (
    UPDATE %[1]s SET backlog_next = NULL, backlog_end = NULL, backlog_bound = NULL
     WHERE topic = $1 AND consumer_group = $2 AND EXISTS (SELECT 1 FROM b)
    RETURNING 1
)
SELECT (SELECT count(*) FROM del), (SELECT count(*) FROM fin)`, n.QBindings, n.QTable)
}

// MoveGroup moves up to $4 waiting rows of group $2 of topic $1 into group
// $3, in place (ids, due times and delivery counts kept): rows nobody
// holds, parked ones included. A row whose dedup key group $3 holds
// already stays. $5 is the channel to wake the subscribers on. Rows are
// found through the ready and lease indexes.
func MoveGroup(n Names) string {
	return fmt.Sprintf(`WITH unleased AS (
    SELECT id FROM %[1]s o
     WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL
       AND (o.dedup_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM %[1]s d WHERE d.topic = $1 AND d.consumer_group = $3 AND d.dedup_key = o.dedup_key AND d.dedup_key IS NOT NULL))
     ORDER BY available_at, id
     LIMIT $4 FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id FROM %[1]s o
     WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NOT NULL AND leased_until < now()
       AND (o.dedup_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM %[1]s d WHERE d.topic = $1 AND d.consumer_group = $3 AND d.dedup_key = o.dedup_key AND d.dedup_key IS NOT NULL))
     ORDER BY leased_until
     LIMIT (SELECT $4::int - count(*) FROM unleased) FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE %[1]s o
       SET consumer_group = $3, lease_token = NULL, leased_until = NULL, leased_by = NULL, lease_holder = NULL
     WHERE o.id = ANY (ARRAY(SELECT id FROM unleased UNION ALL SELECT id FROM expired))
    RETURNING 1
), woken AS (
    SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM moved)
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM woken)`, n.QTable)
}

// GroupWaitingRows counts the rows of group $2 of topic $1 that nobody
// holds under a lease (unleased, or leased until a time past), the rows
// MoveGroup moves, whether or not a transaction has them locked (a held
// batch, a rotation step): what a RenameGroup's move may have left.
func GroupWaitingRows(n Names) string {
	return fmt.Sprintf(`SELECT (SELECT count(*) FROM %[1]s WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL)
     + (SELECT count(*) FROM %[1]s WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NOT NULL AND leased_until < now())`, n.QTable)
}

// GroupRows counts the rows of group $2 of topic $1 (two index range
// scans): Unbind of the default group refuses to turn waiting rows into
// unbound ones.
func GroupRows(n Names) string {
	return fmt.Sprintf(`SELECT (SELECT count(*) FROM %[1]s WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL)
     + (SELECT count(*) FROM %[1]s WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NOT NULL)`, n.QTable)
}
