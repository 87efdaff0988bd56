package query

import "fmt"

// ScheduleMark prefixes the NOTIFY payload of a Publish whose rows are all
// scheduled for later (chr(31), a control character topics cannot hold).
const ScheduleMark = "\x1f"

// GroupMark separates a topic from a consumer group in the payload of a
// subscriber's NOTIFY (query.Complete): returned rows belong to one group,
// so only that group's subscriptions wake. It also prefixes the payload of
// returned rows that are due now (releases, nacks without delay), which is
// how a subscription tells them from a publisher's wake-up. Neither topics
// nor groups may hold control characters.
const GroupMark = "\x1e"

// Queries are the statements of one outbox, with its names templated in.
type Queries struct {
	Names Names

	Publish      string
	PublishPlain string
	// PublishQuiet, PublishPlainQuiet and PublishOneQuiet write the same
	// rows without the NOTIFY (see the notify limiter in the Publisher);
	// PublishOne and PublishOneQuiet write a single message with VALUES.
	PublishQuiet      string
	PublishPlainQuiet string
	PublishOne        string
	PublishOneQuiet   string
	Bind              string
	Unbind            string
	Purge             string
	Claim             string
	// ClaimNoOrphans is Claim without the orphaned branch, for the
	// claims that do not look for orphans (nearly all): the parameters
	// $1..$12 of Claim.
	ClaimNoOrphans string
	// ClaimFast and ClaimFastNoOrphans are the claim of a topic whose
	// waiting rows are not held back by ordering keys: one walk of the
	// ready index, no window, no "heads" (parameters $1..$10, and $11 for
	// the spared holders). They check keys too, so they are correct for
	// any row, but a walk over rows whose keys are held costs the whole
	// backlog: the subscription uses them while it sees no keyed rows.
	ClaimFast          string
	ClaimFastNoOrphans string
	Complete           string
	Ack                string
	CompleteInTx       string
	Renew              string
	Dead               string
	// HeldClaim, HeldAck and HeldFinish are the held path's statements
	// (a claim inside a transaction the subscription keeps open while
	// the handlers run): see their comments in Build.
	HeldClaim    string
	HeldAck      string
	HeldFinish   string
	ReleaseClaim string
	NextDue      string
	Cancel       string
}

// asyncCommit is a condition that is always true and, as a side effect,
// makes the statement's own implicit transaction commit without waiting for
// its WAL to reach disk (set_config(..., true) is local to that transaction,
// and the commit reads the setting before it is reset). It is an
// uncorrelated subquery, so it runs once, and only a statement that writes
// has anything to wait for.
const asyncCommit = ` AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`

// Build templates every statement for the given names. With async, the
// subscriber's own writes (claim, complete, renew, dead) commit
// asynchronously; Publish always follows the caller's setting.
func Build(n Names, async bool) *Queries {
	t := n.QTable
	ac := ""
	if async {
		ac = asyncCommit
	}
	return &Queries{
		Names: n,

		// Publish inserts a whole Publish call in one statement: the messages
		// travel as parallel arrays, unnest turns them back into rows, in call
		// order (ORDER BY ord), so ids follow the order of the slice. Each
		// message becomes one row per consumer group bound to the topic
		// (publishGroups), still one statement whatever their number.
		//
		// A duration delay ($5, microseconds) is applied with the database
		// clock; an absolute time ($6) is stored as given, and one in the past
		// means "now" so it does not jump the queue. ON CONFLICT skips a message
		// whose (topic, group, dedup_key) is already present.
		//
		// NOTIFY rides on the same statement, once per call, and only if a
		// row was inserted (a skipped duplicate wakes nobody). If a row is due
		// now the payload is the topic: idle loops of that topic claim at
		// once. If all rows are scheduled for later, the payload is the topic
		// behind ScheduleMark: loops do not claim, they only ask when the
		// next row is due (query NextDue) and shorten their sleep. NOTIFY is
		// transactional: it fires at commit and vanishes on rollback.
		Publish: fmt.Sprintf(`
WITH ins AS (%[1]s
    RETURNING id, uuid, available_at <= now() AS due
), woken AS (
    SELECT pg_notify($9, CASE WHEN bool_or(due) THEN $1 ELSE %[2]s || $1 END)
      FROM ins HAVING count(*) > 0
)
SELECT id, uuid, (SELECT count(*) FROM woken) FROM ins`, fullInsert(n), "chr(31)"),

		// PublishPlain is Publish for the common call: no message scheduled
		// or keyed. Without ON CONFLICT, the schedule arrays and the RETURNED
		// rows it costs the server and the client less (tests/bench). Every
		// row is due, so it always notifies. The function scan of unnest
		// feeds the INSERT in array order, so each group's ids follow the
		// call order (Watermill's ordering test publishes 1000 messages in
		// one call).
		PublishPlain: fmt.Sprintf(`
WITH ins AS (%s
    RETURNING 1
)
SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)`, plainInsert(n)),

		// Quiet variants: the same rows, no NOTIFY. Most publishing
		// transactions use them: a transaction that NOTIFYs takes a
		// database-wide lock at commit (notifications enter the queue in
		// commit order), which serializes concurrent publishing commits.
		PublishQuiet:      fullInsert(n) + "\nRETURNING id, uuid, 0::bigint",
		PublishPlainQuiet: plainInsert(n),
		// One message, the commonest call: VALUES-like parameters cost the
		// client and the server less than arrays.
		PublishOne: fmt.Sprintf(`
WITH ins AS (%s
    RETURNING 1
)
SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)`, oneInsert(n)),
		PublishOneQuiet: oneInsert(n),

		// Bind binds consumer group $2 to topic $1: from then on every
		// message published to the topic gets a row for the group.
		Bind: fmt.Sprintf(`INSERT INTO %s (topic, consumer_group) VALUES ($1, $2) ON CONFLICT DO NOTHING`, n.QBindings),
		// Unbind removes the binding; Purge deletes the group's rows of the
		// topic that nobody holds: unleased, or leased until a time already
		// past (their holder is gone, and with the group unbound nobody may
		// come to claim them). A delivery under way completes.
		Unbind: fmt.Sprintf(`DELETE FROM %s WHERE topic = $1 AND consumer_group = $2`, n.QBindings),
		Purge: fmt.Sprintf(`DELETE FROM %s WHERE topic = $1 AND consumer_group = $2
   AND (lease_token IS NULL OR leased_until < now())`, t),

		// Claim leases up to $2 rows of topic $1 under token $3.
		//
		// Shape (measured on a 1,000,000-row backlog): one SELECT with
		// "ready OR expired" becomes a sequential scan plus a sort, and
		// UPDATE ... FROM cte may hash-join a sequential scan. A CTE per
		// branch, each repeating its partial index's predicate, is an index
		// range scan each, and "id = ANY(ARRAY(...))" keeps the UPDATE on the
		// primary key. Expired leases are reclaimed here too, so there is no
		// separate reaper. TestClaimUsesPartialIndexes pins this shape.
		//
		// Dead index entries: every claim leaves the ready-index entries of
		// the rows it took behind, dead, at the low end of the range, until
		// VACUUM removes them; a scan from the start walks all of them (2.5ms
		// per claim after 500,000 claimed rows). So a busy loop passes the
		// (available_at, id) of the last ready row it claimed as a cursor
		// ($6, $7); the loop scans from the start again after an idle
		// wake-up, a give-back and every second. The expired branch runs only
		// when $8 is true (every second, or while the last look found some).
		//
		// Every branch reads the rows of one consumer group ($10; '' is the
		// default group): groups never see each other's rows.
		//
		// Orphaned leases: rows whose holder died. A subscriber that holds
		// its liveness lock (see LivenessClass) stamps the rows it leases
		// with the lock's key ($9, NULL when it holds none). Claim (not
		// ClaimNoOrphans) also takes the rows stamped with a key whose lock
		// is not held now, unless the key is one of $11: this process's own
		// and those held at its notifier's last two checks, so a holder
		// counts as dead only once its lock stayed gone for two checks (a
		// LISTEN connection that blips is back within one). The branch reads
		// pg_locks and scans the topic's live leases, so it runs only when
		// the notifier saw a lock vanish, and once at start.
		//
		// Ordering keys: a keyed row is ready only while no older row of
		// its key is present (leased, scheduled, waiting), parked rows
		// aside. The "ready" branch reads a window of at most $11 rows from
		// the cursor (the "scan"), so a backlog of rows whose keys are held
		// costs each claim one window, not the whole backlog; the next
		// claim goes on after it. When rows of keys ended (acked, nacked,
		// dead), their keys come as $12: "heads" takes each key's next row
		// through the ordering-key index, wherever it lies.
		//
		// Every row of the result is a claimed row, with more columns: the
		// last row the scan read (the next cursor: available_at, id), how
		// many expired or orphaned leases were taken, and how many rows of
		// the window were not held back by their keys (claimed, or locked
		// by a competitor's claim). When nothing was claimed, one row of
		// NULLs carries them.
		Claim:              claimStatement(t, ac, true),
		ClaimNoOrphans:     claimStatement(t, ac, false),
		ClaimFast:          claimFastStatement(t, ac, true),
		ClaimFastNoOrphans: claimFastStatement(t, ac, false),

		// Complete applies a batch of acks, lease returns and holds in one
		// statement. Every row is matched on (id, lease_token): a row whose
		// lease expired and was claimed by someone else does not match, and
		// is reported by the absence of its (id, token) pair from the result
		// (lease lost) instead of being touched.
		//
		// Acks ($1, $2) delete. Returns ($3..$8) clear the lease and set when
		// the row is due again: delay_us NULL keeps available_at (a release
		// keeps the row's place in line), otherwise now() + delay. undo = 1
		// takes back the delivery count of a row claimed but never handed to
		// a handler. err and meta NULL keep the stored values. Holds ($9..$12)
		// keep the lease of a nacked row that an ordered subscription will
		// deliver again itself, counting that delivery now.
		//
		// A return that makes a row due wakes the idle subscribers of the
		// topic and group (NOTIFY $14 with the payload GroupMark || $15,
		// where $15 is topic GroupMark group; a row due later sends
		// ScheduleMark || $15). The row it adds to the result has id 0.
		Complete: fmt.Sprintf(`
WITH acked AS (
    DELETE FROM %[1]s o
     USING unnest($1::bigint[], $2::uuid[]) AS c(id, token)
     WHERE o.id = c.id AND o.lease_token = c.token%[2]s
    RETURNING o.id, c.token
), returned AS (
    UPDATE %[1]s o
       SET lease_token  = NULL,
           leased_until = NULL,
           leased_by    = NULL,
           lease_holder = NULL,
           available_at = CASE WHEN c.delay_us IS NULL THEN o.available_at
                               ELSE now() + c.delay_us * interval '1 microsecond' END,
           deliveries   = o.deliveries - c.undo,
           last_error   = coalesce(c.err, o.last_error),
           metadata     = coalesce(c.meta::jsonb, o.metadata)
      FROM unnest($3::bigint[], $4::uuid[], $5::bigint[], $6::int[], $7::text[], $8::text[])
           AS c(id, token, delay_us, undo, err, meta)
     WHERE o.id = c.id AND o.lease_token = c.token%[2]s
    RETURNING o.id, c.token, o.available_at <= now() AS due
), held AS (
    UPDATE %[1]s o
       SET deliveries   = o.deliveries + 1,
           leased_until = now() + $13::bigint * interval '1 microsecond',
           last_error   = coalesce(c.err, o.last_error),
           metadata     = coalesce(c.meta::jsonb, o.metadata)
      FROM unnest($9::bigint[], $10::uuid[], $11::text[], $12::text[]) AS c(id, token, err, meta)
     WHERE o.id = c.id AND o.lease_token = c.token%[2]s
    RETURNING o.id, c.token
), woken AS (
    SELECT pg_notify($14, CASE WHEN bool_or(due) THEN chr(30) ELSE %[3]s END || $15)
      FROM returned HAVING count(*) > 0
)
SELECT id, token FROM acked
UNION ALL SELECT id, token FROM returned
UNION ALL SELECT id, token FROM held
UNION ALL SELECT 0, NULL::uuid FROM woken`, t, ac, "chr(31)"),

		// Ack is Complete for a batch of acks alone, the common batch: one
		// DELETE, without the other branches' planning and parameters.
		Ack: fmt.Sprintf(`
DELETE FROM %[1]s o
 USING unnest($1::bigint[], $2::uuid[]) AS c(id, token)
 WHERE o.id = c.id AND o.lease_token = c.token%[2]s
RETURNING o.id, c.token`, t, ac),

		// CompleteInTx deletes a delivered row in the transaction of the
		// handler that processed it (tx.Middleware), under its lease token:
		// 0 rows means the lease was lost and the transaction must roll
		// back. No asynchronous-commit clause: that transaction commits
		// the handler's own writes, with the user's durability.
		CompleteInTx: fmt.Sprintf(`DELETE FROM %s WHERE id = $1 AND lease_token = $2`, t),

		// HeldClaim locks up to $2 ready rows of topic $1 and group $3, from
		// the cursor ($4, $5), in the transaction that runs it: the held
		// path. It writes nothing: no new row version, no index entry.
		// Competitors' claims skip the locked rows (SKIP LOCKED); if the
		// holder dies, its transaction rolls back and the rows are due
		// again at once, their delivery not counted. The ready predicate,
		// ordering keys included, is ClaimFast's. The delivery count it
		// returns is the one this delivery makes (stored only if the row
		// becomes a lease or is nacked).
		HeldClaim: fmt.Sprintf(`
SELECT id, uuid, payload, metadata, deliveries + 1, available_at, ordering_key
  FROM %[1]s r
 WHERE topic = $1 AND consumer_group = $3 AND lease_token IS NULL AND available_at <= now()
   AND (available_at, id) > ($4::timestamptz, $5::bigint)
   AND %[2]s`+NotPaused(t, "$3")+`
 ORDER BY available_at, id
 LIMIT $2::int
   FOR UPDATE OF r SKIP LOCKED`, t, keyIsFree(t, "r", "$3")),

		// HeldAck deletes the acked rows of a held claim, in its
		// transaction: the locks make a token unnecessary.
		HeldAck: fmt.Sprintf(`DELETE FROM %s WHERE id = ANY ($1::bigint[])`, t),

		// HeldFinish is HeldAck plus the rows of the held claim that leave
		// it without an ack (a handler still running at the bound, a nack,
		// a dead letter): they become ordinary leases under token $3,
		// counting their delivery, before the transaction commits. Their
		// nacks and dead letters are then written like any lease's.
		HeldFinish: fmt.Sprintf(`
WITH acked AS (
    DELETE FROM %[1]s WHERE id = ANY ($1::bigint[])
)
UPDATE %[1]s
   SET lease_token  = $3::uuid,
       leased_until = now() + $4::bigint * interval '1 microsecond',
       leased_by    = $5,
       lease_holder = $6::bigint,
       deliveries   = deliveries + 1
 WHERE id = ANY ($2::bigint[])`, t),

		// Dead ends rows terminally, under their tokens: with a dead-letter
		// table the row moves there in this one statement (if the INSERT
		// fails the DELETE rolls back, the row stays leased and comes back:
		// never lost); without one the row is parked in the outbox: never
		// due again, its reason and error kept for an operator.
		Dead: deadStatement(n, ac),

		// Renew extends the leases of held rows, under their tokens, and
		// stamps them with the holder's current liveness key ($4, NULL when
		// it holds none): a process that had to take a new key must not
		// leave rows under its old one, which looks dead.
		Renew: fmt.Sprintf(`
UPDATE %[1]s o
   SET leased_until = now() + $3::bigint * interval '1 microsecond',
       lease_holder = $4::bigint
  FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
 WHERE o.id = c.id AND o.lease_token = c.token%[2]s
RETURNING o.id, c.token`, t, ac),

		// ReleaseClaim gives back every row of topic $1 and group $3 still
		// leased under the tokens $2, undoing their delivery count: the
		// claims that leased them failed on the client's side (the reply
		// was lost), so no handler saw those rows. Scans the group's leased
		// rows of the topic only.
		ReleaseClaim: fmt.Sprintf(`
UPDATE %[1]s
   SET lease_token = NULL, leased_until = NULL, leased_by = NULL, lease_holder = NULL,
       deliveries = deliveries - 1
 WHERE topic = $1 AND consumer_group = $3 AND lease_token IS NOT NULL
   AND lease_token = ANY ($2::uuid[])%[2]s`, t, ac),

		// NextDue returns the microseconds until the next row of topic $1
		// and group $2 becomes claimable in the future (a scheduled row or an expiring
		// lease), or NULL. Rows due already are left out: if the claim did
		// not get them, another consumer holds them locked right now. Each
		// branch is a one-row scan of its partial index, starting at now():
		// the dead entries acked rows leave behind lie below it.
		NextDue: fmt.Sprintf(`
SELECT (extract(epoch FROM least(
           (SELECT min(available_at) FROM %[1]s
             WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL AND available_at > now()
               AND available_at < 'infinity'),
           (SELECT min(leased_until) FROM %[1]s
             WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NOT NULL AND leased_until > now())
       ) - now()) * 1000000)::bigint`, t),

		// Cancel deletes a scheduled row by key, in every consumer group,
		// but only while nobody holds it: a delivery already running
		// completes normally. The dedup index is led by (topic,
		// consumer_group), so the groups holding keyed rows of the topic
		// are found first, one index probe each (a loose index scan), and
		// each group's row is then looked up by its full key: filtering the
		// key over the topic's whole range would read every keyed row.
		Cancel: fmt.Sprintf(`
WITH RECURSIVE grp(g) AS (
    (SELECT consumer_group FROM %[1]s WHERE topic = $1 AND dedup_key IS NOT NULL
      ORDER BY consumer_group LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer_group FROM %[1]s WHERE topic = $1 AND dedup_key IS NOT NULL AND consumer_group > grp.g
             ORDER BY consumer_group LIMIT 1)
      FROM grp WHERE grp.g IS NOT NULL
)
DELETE FROM %[1]s
 WHERE topic = $1 AND consumer_group IN (SELECT g FROM grp WHERE g IS NOT NULL)
   AND dedup_key = $2 AND lease_token IS NULL`, t),
	}
}

func deadStatement(n Names, ac string) string {
	if n.QDLQ == "" {
		// Parked: available_at 'infinity' is never due, and the ready
		// index keeps the row out of every claim's way at its far end.
		return fmt.Sprintf(`
UPDATE %[1]s o
   SET lease_token = NULL, leased_until = NULL, leased_by = NULL, lease_holder = NULL,
       available_at   = 'infinity',
       failure_reason = c.reason,
       last_error     = coalesce(c.err, o.last_error)
  FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::text[]) AS c(id, token, reason, err)
 WHERE o.id = c.id AND o.lease_token = c.token%[2]s
RETURNING o.id, c.token`, n.QTable, ac)
	}
	// The INSERT runs although nothing reads its result: PostgreSQL always
	// executes data-modifying CTEs, and a failure fails the whole statement.
	return fmt.Sprintf(`WITH dead AS (
    DELETE FROM %[1]s o
     USING unnest($1::bigint[], $2::uuid[], $3::text[], $4::text[]) AS c(id, token, reason, err)
     WHERE o.id = c.id AND o.lease_token = c.token%[2]s
    RETURNING o.id, o.topic, o.consumer_group, o.uuid, o.payload, o.metadata, o.created_at, o.deliveries,
              o.dedup_key, coalesce(c.err, o.last_error) AS last_error, c.reason, o.leased_by, c.token, o.ordering_key
), moved AS (
    INSERT INTO %[3]s (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries,
                    dedup_key, last_error, failure_reason, failed_by, ordering_key)
    SELECT id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries,
           dedup_key, last_error, reason, leased_by, ordering_key FROM dead
)
SELECT id, token FROM dead`, n.QTable, ac, n.QDLQ)
}

// LivenessClass is the first key of every liveness lock
// (pg_advisory_lock(LivenessClass, key)): "pgob" in ASCII, positive, so
// pg_locks shows it unchanged as classid.
const LivenessClass = 0x70676f62

// Liveness statements. A Subscriber's LISTEN connection holds a session
// advisory lock (LivenessClass, key) while it is up; the server drops it the
// moment that connection ends, which is when its process dies. The key is a
// random positive int4, stored with every row the subscriber leases
// (lease_holder).
var (
	TryLiveness = fmt.Sprintf(`SELECT pg_try_advisory_lock(%d, $1::int)`, LivenessClass)
	// LiveHolders lists the keys whose locks are held, in this database.
	LiveHolders = fmt.Sprintf(`SELECT objid::bigint FROM pg_catalog.pg_locks
                    WHERE locktype = 'advisory' AND classid = %d AND objsubid = 2 AND granted
                      AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())`, LivenessClass)
	// LiveHoldersMine is LiveHolders with, per key, whether this session
	// holds it: behind a pooler (PgBouncer) the lock may sit on a server
	// connection that is not, or no longer, the one this session uses.
	LiveHoldersMine = fmt.Sprintf(`SELECT objid::bigint, pid = pg_backend_pid() FROM pg_catalog.pg_locks
                    WHERE locktype = 'advisory' AND classid = %d AND objsubid = 2 AND granted
                      AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())`, LivenessClass)
)

// claimStatement builds query.Claim; see its comment. Without orphans, the
// orphaned branch is left out (it would be skipped at run time, but its
// planning and subplans cost every claim).
// leaseBranches returns the claim's first CTEs, from "WITH expired AS (" to
// before the closing parenthesis of the last one (expired, and orphaned
// when asked, sparing the holders of parameter spare), what the result
// counts of them, the ids they add to the update, and the limit left for
// ready rows.
func leaseBranches(t string, orphans bool, spare string) (ctes, count, ids, readyLimit string) {
	ctes = fmt.Sprintf(`
WITH expired AS (
    SELECT id FROM %s
     WHERE $8::bool AND topic = $1 AND consumer_group = $10 AND lease_token IS NOT NULL AND leased_until < now()`+NotPaused(t, "$10")+`
     ORDER BY leased_until
     LIMIT $2::int
       FOR UPDATE SKIP LOCKED`, t)
	if !orphans {
		return ctes, "0", "", "(SELECT $2::int - count(*) FROM expired)"
	}
	ctes += fmt.Sprintf(`
), orphaned AS (
    SELECT id FROM %[1]s
     WHERE topic = $1 AND consumer_group = $10 AND lease_token IS NOT NULL AND leased_until >= now()
       AND lease_holder <> ALL (%[3]s::bigint[])
       AND lease_holder NOT IN (%[2]s)`+NotPaused(t, "$10")+`
     LIMIT (SELECT $2::int - count(*) FROM expired)
       FOR UPDATE SKIP LOCKED`, t, LiveHolders, spare)
	return ctes, "(SELECT count(*) FROM orphaned)", " UNION ALL SELECT id FROM orphaned",
		"(SELECT $2::int - count(*) FROM expired) - (SELECT count(*) FROM orphaned)"
}

// claimFastStatement builds query.ClaimFast; see its comment. Its result
// has the columns of claimStatement's, but only claimed rows: the cursor
// is the last ready row claimed, and "free" the number of ready rows.
func claimFastStatement(t, ac string, orphans bool) string {
	expired, orphanedCount, orphanedIDs, readyLimit := leaseBranches(t, orphans, "$11")
	return fmt.Sprintf(`%[3]s
), ready AS (
    SELECT id, available_at FROM %[1]s r
     WHERE topic = $1 AND consumer_group = $10 AND lease_token IS NULL AND available_at <= now()
       AND (available_at, id) > ($6::timestamptz, $7::bigint)
       AND %[7]s`+NotPaused(t, "$10")+`
     ORDER BY available_at, id
     LIMIT %[6]s
       FOR UPDATE SKIP LOCKED
), last_ready AS (
    SELECT available_at, id FROM ready ORDER BY available_at DESC, id DESC LIMIT 1
)
UPDATE %[1]s o
   SET lease_token  = $3::uuid,
       leased_until = now() + $4::bigint * interval '1 microsecond',
       leased_by    = $5,
       lease_holder = $9::bigint,
       deliveries   = o.deliveries + 1
 WHERE o.id = ANY (ARRAY(SELECT id FROM expired%[5]s UNION ALL SELECT id FROM ready))%[2]s
RETURNING o.id, o.uuid, o.payload, o.metadata, o.deliveries, o.available_at, o.ordering_key,
          (SELECT available_at FROM last_ready), (SELECT id FROM last_ready),
          (SELECT count(*) FROM expired) + %[4]s, (SELECT count(*) FROM ready)`, t, ac, expired, orphanedCount, orphanedIDs, readyLimit,
		keyIsFree(t, "r", "$10"))
}

func claimStatement(t, ac string, orphans bool) string {
	expired, orphanedCount, orphanedIDs, readyLimit := leaseBranches(t, orphans, "$13")
	return fmt.Sprintf(`%[3]s
), heads AS (
    SELECT h.id FROM unnest($12::text[]) AS e(k)
     CROSS JOIN LATERAL (
        SELECT id, available_at, lease_token FROM %[1]s
         WHERE topic = $1 AND consumer_group = $10 AND ordering_key = e.k AND available_at < 'infinity'
         ORDER BY id LIMIT 1) h
     WHERE h.lease_token IS NULL AND h.available_at <= now()`+NotPaused(t, "$10")+`
               AND NOT EXISTS (
                   SELECT 1 FROM %[1]s l
                    WHERE l.topic = $1 AND l.consumer_group = $10 AND l.ordering_key = e.k
                      AND l.lease_token IS NOT NULL)
), scan AS (
    SELECT id, available_at, ordering_key FROM %[1]s
     WHERE topic = $1 AND consumer_group = $10 AND lease_token IS NULL AND available_at <= now()
       AND (available_at, id) > ($6::timestamptz, $7::bigint)`+NotPaused(t, "$10")+`
     ORDER BY available_at, id
     LIMIT $11::int
), candidates AS (
    SELECT c.id FROM scan c
     WHERE %[7]s
), ready AS (
    SELECT id, available_at FROM %[1]s
     WHERE id = ANY (ARRAY(SELECT id FROM heads UNION SELECT id FROM candidates))
       AND lease_token IS NULL AND available_at <= now()
     ORDER BY available_at, id
     LIMIT %[6]s
       FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE %[1]s o
       SET lease_token  = $3::uuid,
           leased_until = now() + $4::bigint * interval '1 microsecond',
           leased_by    = $5,
           lease_holder = $9::bigint,
           deliveries   = o.deliveries + 1
     WHERE o.id = ANY (ARRAY(SELECT id FROM expired%[5]s UNION ALL SELECT id FROM ready))%[2]s
    RETURNING o.id, o.uuid, o.payload, o.metadata, o.deliveries, o.available_at, o.ordering_key
), next_cursor AS (
    -- A full claim stops at its last ready row of the window: the rows
    -- after it are for the next claim. Otherwise the whole window is done.
    SELECT * FROM (SELECT available_at, id FROM ready WHERE id IN (SELECT id FROM scan)
                    ORDER BY available_at DESC, id DESC LIMIT 1) r
     WHERE (SELECT count(*) FROM ready) >= %[6]s
    UNION ALL
    SELECT * FROM (SELECT available_at, id FROM scan ORDER BY available_at DESC, id DESC LIMIT 1) s
     WHERE (SELECT count(*) FROM ready) < %[6]s
)
SELECT c.id, c.uuid, c.payload, c.metadata, c.deliveries, c.available_at, c.ordering_key,
       l.available_at, l.id, (SELECT count(*) FROM expired) + %[4]s, (SELECT count(*) FROM candidates)
  FROM (SELECT 1) AS one
  LEFT JOIN claimed c ON true
  LEFT JOIN next_cursor l ON true`, t, ac, expired, orphanedCount, orphanedIDs, readyLimit,
		keyIsFree(t, "c", "$10"))
}

// keyIsFree is the ordering-key condition of every claim, for the row
// aliased row of topic $1 and group group: an unkeyed row, or one whose
// key has no older row present (parked rows aside) and no leased row (a
// row committed late may have a higher id than a leased one of its key).
func keyIsFree(t, row, group string) string {
	return fmt.Sprintf(`(%[2]s.ordering_key IS NULL OR (NOT EXISTS (
        SELECT 1 FROM %[1]s k
         WHERE k.topic = $1 AND k.consumer_group = %[3]s AND k.ordering_key = %[2]s.ordering_key
           AND k.id < %[2]s.id AND k.available_at < 'infinity')
       AND NOT EXISTS (
        SELECT 1 FROM %[1]s l
         WHERE l.topic = $1 AND l.consumer_group = %[3]s AND l.ordering_key = %[2]s.ordering_key
           AND l.lease_token IS NOT NULL)))`, t, row, group)
}

// publishGroups is the consumer groups a message of topic $1 gets a row
// for: every group bound to the topic, or the default group ” when none
// is, so a message published before any binding is kept (for subscribers
// without a group). Two lookups of the bindings' primary key.
func publishGroups(n Names) string {
	return fmt.Sprintf(`(SELECT consumer_group FROM %[1]s WHERE topic = $1
                 UNION ALL
                 SELECT '' WHERE NOT EXISTS (SELECT 1 FROM %[1]s WHERE topic = $1)) AS g(consumer_group)`, n.QBindings)
}

func fullInsert(n Names) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata, available_at, dedup_key, ordering_key)
    SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb,
           CASE WHEN m.delay_us IS NOT NULL THEN now() + m.delay_us * interval '1 microsecond'
                WHEN m.at IS NOT NULL THEN greatest(m.at, now())
                ELSE now() END,
           m.dedup_key, m.ordering_key
      FROM unnest($2::text[], $3::bytea[], $4::text[], $5::bigint[], $6::timestamptz[], $7::text[], $8::text[])
           WITH ORDINALITY AS m(uuid, payload, metadata, delay_us, at, dedup_key, ordering_key, ord)
     CROSS JOIN %[2]s
     ORDER BY m.ord, g.consumer_group
        ON CONFLICT (topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING`, n.QTable, publishGroups(n))
}

func plainInsert(n Names) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata)
    SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb
      FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata)
     CROSS JOIN %[2]s`, n.QTable, publishGroups(n))
}

func oneInsert(n Names) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata)
    SELECT $1, g.consumer_group, $2, $3, $4::jsonb FROM %[2]s`, n.QTable, publishGroups(n))
}
