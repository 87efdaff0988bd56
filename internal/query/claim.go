package query

import (
	"fmt"

	"github.com/jackc/pgx/v5/pgtype"
)

// ClaimStatements take rows: the lease claims (ClaimFast while no keyed
// rows are seen, Claim with a window and the keys that ended; each without
// the orphaned branch too), the held claim, the key verifications after
// a claim (keys.go), the release of a lost claim's rows and the look at
// when the next row is due.
type ClaimStatements struct {
	Claim              string
	ClaimNoOrphans     string
	ClaimFast          string
	ClaimFastNoOrphans string
	HeldClaim          string
	KeyLockHeld        string
	KeyVerifyLease     string
	KeyVerifyHeld      string
	ReleaseClaim       string
	NextDue            string
	arrivals           bool // the outbox has arrivals: the lease claims take an arrivals cursor last
}

func buildClaim(n Names, ac string) ClaimStatements {
	t := n.QTable
	return ClaimStatements{
		arrivals: n.Arrivals,
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
		// when $8 is not NULL (every second, or while the last look found
		// some), and reads leases that ended from $8 on: every acked lease
		// leaves a dead entry in the lease index at its end, and while a
		// snapshot holds vacuum back, a look from the start walked all of
		// them (0.4 s a look after a minute at 2,000 msg/s). A lease ends
		// while it is visible (it is written ending in the future), so a
		// look from the last one's start finds every lease that ended since;
		// one it skipped, locked, is found by the next look from the start.
		// Every row of the result carries the statement's now() last, the
		// next look's bound.
		//
		// Every branch reads the rows of one consumer group ($10; '' is the
		// default group): groups never see each other's rows.
		//
		// Orphaned leases: rows whose holder died. A subscriber that holds
		// its liveness lock (see LivenessClass) stamps the rows it leases
		// with the lock's key ($9, NULL when it holds none). Claim (not
		// ClaimNoOrphans) also takes the rows stamped with a key whose lock
		// is not held now, unless the key is one of $11: this process's own
		// and those its notifier saw held within the last second, so a
		// holder counts as dead only once its lock stayed gone for a second
		// (a LISTEN connection that blips is back sooner). The branch reads
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
		// many expired or orphaned leases were taken (or, fresh only,
		// passed over), how many rows of the window were not held back by
		// their keys (claimed, or locked by a competitor's claim), the
		// statement's now(), when it checked its deadline (inTime) and
		// whether it passed over a row delivered before (freshOnly). When
		// nothing was claimed, one row of NULLs carries them.
		Claim:              claimStatement(n, ac, true),
		ClaimNoOrphans:     claimStatement(n, ac, false),
		ClaimFast:          claimFastStatement(n, ac, true),
		ClaimFastNoOrphans: claimFastStatement(n, ac, false),

		// HeldClaim locks up to $2 ready rows of topic $1 and group $3, from
		// the cursor ($4, $5), in the transaction that runs it: the held
		// path. It writes nothing: no new row version, no index entry.
		// Competitors' claims skip the locked rows (SKIP LOCKED); if the
		// holder dies, its transaction rolls back and the rows are due
		// again at once, their delivery not counted. The ready predicate,
		// ordering keys included, is ClaimFast's. The delivery count it
		// returns is the one this delivery makes (stored only if the row
		// becomes a lease or is nacked).
		HeldClaim: heldClaim(n, fmt.Sprintf(`
SELECT id, uuid, payload, metadata, deliveries + 1, available_at, ordering_key, created_at
  FROM %[1]s r
 WHERE topic = $1 AND consumer_group = $3 AND lease_token IS NULL AND available_at <= now()
   AND (available_at, id) > ($4::timestamptz, $5::bigint)
   AND %[2]s`+NotPaused(t, "$3")+`
 ORDER BY available_at, id
 LIMIT $2::int
   FOR UPDATE OF r SKIP LOCKED`, t, keyIsFree(t, "r", "$3"))),

		KeyLockHeld:    keyLockHeld(n),
		KeyVerifyLease: keyVerifyLease(n, ac),
		KeyVerifyHeld:  keyVerifyHeld(n),

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
	}
}

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
WITH `+onTimeCTE+`, expired AS (
    SELECT id FROM %s
     WHERE $8::timestamptz IS NOT NULL AND topic = $1 AND consumer_group = $10 AND lease_token IS NOT NULL
       AND leased_until < now() AND leased_until >= $8::timestamptz`+NotPaused(t, "$10")+`
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
// has the columns of claimStatement's: the cursor is the last ready row
// claimed, and "free" the number of ready rows.
func claimFastStatement(n Names, ac string, orphans bool) string {
	t := n.QTable
	expired, orphanedCount, orphanedIDs, readyLimit := leaseBranches(t, orphans, "$11")
	last := map[bool]int{false: 10, true: 11}[orphans]
	onTime := inTime(last, n.Arrivals)
	freshTaken, passedDelivered := freshOnly(last, n.Arrivals, orphanedCount)
	arr, from, cols := arrivalsOfClaim(n, fmt.Sprintf("$%d", last+1), readyLimit, onTime)
	return fmt.Sprintf(`%[3]s
), ready AS (
    SELECT id, available_at, deliveries FROM %[1]s r
     WHERE topic = $1 AND consumer_group = $10 AND lease_token IS NULL AND available_at <= now()
       AND (available_at, id) > ($6::timestamptz, $7::bigint)
       AND %[7]s`+NotPaused(t, "$10")+`
     ORDER BY available_at, id
     LIMIT %[6]s
       FOR UPDATE SKIP LOCKED%[8]s
), last_ready AS (
    SELECT available_at, id FROM ready ORDER BY available_at DESC, id DESC LIMIT 1
), claimed AS (
    UPDATE %[1]s o`+leaseTaken+`
     WHERE o.id = ANY (ARRAY(SELECT id FROM expired%[5]s UNION ALL SELECT id FROM ready))%[2]s%[11]s%[12]s
    RETURNING o.id, o.uuid, o.payload, o.metadata, o.deliveries, o.available_at, o.ordering_key, o.created_at
)
SELECT c.id, c.uuid, c.payload, c.metadata, c.deliveries, c.available_at, c.ordering_key, c.created_at,
       (SELECT available_at FROM last_ready), (SELECT id FROM last_ready),
       (SELECT count(*) FROM expired) + %[4]s, (SELECT count(*) FROM ready), now(), (SELECT at FROM on_time), %[13]s%[10]s
  FROM (SELECT 1) AS one
  LEFT JOIN %[9]s c ON true`, t, ac, expired, orphanedCount, orphanedIDs, readyLimit,
		keyIsFree(t, "r", "$10"), arr, from, cols, onTime, freshTaken, passedDelivered)
}

func claimStatement(n Names, ac string, orphans bool) string {
	t := n.QTable
	expired, orphanedCount, orphanedIDs, readyLimit := leaseBranches(t, orphans, "$13")
	last := map[bool]int{false: 12, true: 13}[orphans]
	onTime := inTime(last, n.Arrivals)
	freshTaken, passedDelivered := freshOnly(last, n.Arrivals, orphanedCount)
	arr, from, cols := arrivalsOfClaim(n, fmt.Sprintf("$%d", last+1), readyLimit, onTime)
	return fmt.Sprintf(`%[3]s
), heads AS (
    SELECT h.id FROM unnest($12::text[]) AS e(k)
     CROSS JOIN LATERAL (
        -- The key's first row: the one without an older row (parked rows
        -- aside). Not "ORDER BY id LIMIT 1": the planner may take that
        -- order from the primary key and filter for the key from its start
        -- (see olderOfKey); without an order only the ordering-key index
        -- finds the key's rows, in id order, the first row first. The
        -- look for an older row is a subplan per row (OFFSET 0, see
        -- olderOfKey).
        SELECT f.id, f.available_at, f.lease_token FROM %[1]s f
         WHERE f.topic = $1 AND f.consumer_group = $10 AND f.ordering_key = e.k AND f.available_at < 'infinity'
           AND NOT EXISTS (
               SELECT 1 FROM %[1]s k
                WHERE k.topic = $1 AND k.consumer_group = $10 AND k.ordering_key = e.k
                  AND `+olderOfKey("k", "e.k", "f.id")+` AND k.available_at < 'infinity'
               OFFSET 0)
         LIMIT 1) h
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
    -- Of a key's rows in the window only the oldest can be free: the
    -- others have it, present, as an older row. So only it is probed;
    -- a window of a few keys' backlog costs a probe a key, not a row.
    SELECT c.id FROM (SELECT s.id, s.ordering_key, min(s.id) OVER (PARTITION BY s.ordering_key) AS oldest
                        FROM scan s) c
     WHERE c.ordering_key IS NULL OR (c.id = c.oldest AND %[7]s)
), ready AS (
    -- The rows chosen are probed by id. "num_nulls(lease_token) = 1" is
    -- "not leased" in a form that does not match the ready index's
    -- predicate, so the planner cannot walk that index with the ids as a
    -- filter, reading the whole ready range and its dead entries (it did
    -- on a partitioned outbox: 480 ms a claim under a held snapshot).
    SELECT id, available_at, deliveries FROM %[1]s
     WHERE id = ANY (ARRAY(SELECT id FROM heads UNION SELECT id FROM candidates))
       AND num_nulls(lease_token) = 1 AND available_at <= now()
     ORDER BY available_at, id
     LIMIT %[6]s
       FOR UPDATE SKIP LOCKED%[8]s
), claimed AS (
    UPDATE %[1]s o`+leaseTaken+`
     WHERE o.id = ANY (ARRAY(SELECT id FROM expired%[5]s UNION ALL SELECT id FROM ready))%[2]s%[11]s%[12]s
    RETURNING o.id, o.uuid, o.payload, o.metadata, o.deliveries, o.available_at, o.ordering_key, o.created_at
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
SELECT c.id, c.uuid, c.payload, c.metadata, c.deliveries, c.available_at, c.ordering_key, c.created_at,
       l.available_at, l.id, (SELECT count(*) FROM expired) + %[4]s, (SELECT count(*) FROM candidates), now(), (SELECT at FROM on_time), %[13]s%[10]s
  FROM (SELECT 1) AS one
  LEFT JOIN %[9]s c ON true
  LEFT JOIN next_cursor l ON true`, t, ac, expired, orphanedCount, orphanedIDs, readyLimit,
		keyIsFree(t, "c", "$10"), arr, from, cols, onTime, freshTaken, passedDelivered)
}

// arrivalsOfClaim is what a lease claim adds for an outbox with arrivals
// (see arrivalsLeaseBranch): its CTEs after the ready rows, the rows it
// returns (the claimed ones and the arrivals moved), and two more result
// columns: the last arrival taken (the next arrivals cursor) and whether
// arrivals of other groups wait. cursor is the arrivals cursor's
// parameter. Without arrivals: nothing, and the claimed rows.
func arrivalsOfClaim(n Names, cursor, readyLimit, onTime string) (ctes, from, cols string) {
	if !n.Arrivals {
		return "", "claimed", ""
	}
	return arrivalsLeaseBranch(n, cursor+"::bigint", readyLimit+" - (SELECT count(*) FROM ready)", onTime),
		"(SELECT * FROM claimed UNION ALL SELECT * FROM moved)",
		",\n       (SELECT max(id) FROM arrivals_pick), " + arrivalsShared(n)
}

// inTime is the condition that keeps a lease claim from taking anything
// when the server starts it after its deadline: the parameter after the
// variant's last (last, and the arrivals cursor when the outbox has
// arrivals), NULL for none. A claim the network held back (a path that
// stopped forwarding, then delivered what it held) would otherwise run
// long after its client gave up on it, and lease rows for a whole Lease
// under a token nobody holds, past the time the client stopped trying to
// give them back: an ordered subscription's next row then went out before
// them, and their keys waited a Lease. Checked by the time of on_time
// (onTimeCTE), which the claim also returns: the client judges by it
// whether the claim was late, as the server did.
func inTime(last int, arrivals bool) string {
	p := last + 1
	if arrivals {
		p++
	}
	return fmt.Sprintf(" AND (SELECT $%[1]d::timestamptz IS NULL OR at <= $%[1]d::timestamptz FROM on_time)", p)
}

// freshOnly is what a lease claim adds to take only rows never delivered
// (MaxDeliveries, while messages of its subscription are out): the
// condition on the rows it leases, and the result column that says whether
// it passed over a row delivered before (an expired or orphaned lease, or
// a ready row with a delivery counted), which it locked and left as it
// was. Its parameter is the one after the deadline's (inTime), false for
// a claim that takes every row. Leased beside messages in flight, such a
// row had its delivery counted, and a crash of one of them before the row
// went back counted it again: a row that crashed nothing could reach
// MaxDeliveries. The subscription claims it once nothing else is out.
func freshOnly(last int, arrivals bool, orphanedCount string) (taken, passed string) {
	p := last + 2
	if arrivals {
		p++
	}
	return fmt.Sprintf(" AND (NOT $%d::boolean OR o.deliveries = 0)", p),
		fmt.Sprintf(`$%d::boolean AND ((SELECT count(*) FROM expired) + %s > 0 OR EXISTS (SELECT 1 FROM ready WHERE deliveries > 0))`, p, orphanedCount)
}

// onTimeCTE is the time a lease claim first checks its deadline by: read
// once (materialized), by clock_timestamp(), not now(). now() is when the
// transaction began, before any wait for a table's lock (a CREATE INDEX
// holds one): a claim that reached the server in time but waited there
// past its deadline, its client's cancel lost, leased rows when the lock
// went. The condition depends on no row, so it runs before the claim's
// scans (a one-time filter): a claim late already takes nothing. Scans
// that run long past the deadline (a backlog held back by its keys) are
// caught by ClaimDeadline, the claim's last statement, whose time is the
// one the client reads the server's clock by.
const onTimeCTE = `on_time AS MATERIALIZED (SELECT clock_timestamp() AS at)`

// ClaimDeadline is a lease claim's last statement, in its transaction:
// it fails, rolling the claim back, when the server reaches it after the
// claim's deadline ($1; NULL: none), so a claim that ran past the time its
// client gave up on it (its cancel request lost) leases nothing, however
// long its scans took. SQL has no RAISE: the failure is a cast of a text
// that says what happened (SQLSTATE 22007, DeadlineMarker in its
// message). Otherwise it returns the server's time, the claim's last
// reading of the clock: read before the claim's scans (on_time), the
// reading put the server behind by the claim's length, and the next
// claim's deadline early by as much, which a claim as slow as that one
// then missed, and the next, and so on.
const ClaimDeadline = `SELECT CASE WHEN clock_timestamp() > $1::timestamptz
            THEN ('` + DeadlineMarker + ` by ' || (clock_timestamp() - $1::timestamptz)::text)::timestamptz
            ELSE clock_timestamp() END`

// DeadlineMarker is in the message of ClaimDeadline's failure.
const DeadlineMarker = "pgoutbox: the lease claim ran past its deadline"

// heldClaim is HeldClaim for an outbox with arrivals (arrivalsHeld) or
// without.
func heldClaim(n Names, outbox string) string {
	if !n.Arrivals {
		return outbox
	}
	return arrivalsHeld(n, outbox)
}

// leaseTaken is what every lease claim writes to the rows it takes: its
// token ($3), the lease's end ($4 microseconds from now), the worker ($5),
// its liveness key ($9), one more delivery.
const leaseTaken = `
   SET lease_token  = $3::uuid,
       leased_until = now() + $4::bigint * interval '1 microsecond',
       leased_by    = $5,
       lease_holder = $9::bigint,
       deliveries   = o.deliveries + 1`

// ClaimSettings sets what every claim's transaction runs with (a SELECT
// of set_config calls, local to the transaction).
//
// Generic plans (plan_cache_mode): with a cursor among a claim's
// arguments the planner estimated each custom plan cheaper than the
// generic one, so it planned every claim anew: 0.6 ms of server time per
// lease claim, a third of a held claim's. The generic plan has the same
// shape (TestClaimUsesPartialIndexes checks both). This applies to
// prepared statements, pgx's default; a pool in simple-protocol or exec
// mode (a pooler in transaction mode) plans each claim anyway, and the
// other settings still hold.
//
// No JIT: a claim reads a few hundred rows through indexes, but its
// estimated cost grows with the table (LIMIT under FOR UPDATE is costed
// as the whole range) and crosses jit_above_cost from about 100,000 ready
// rows on; compiling then took 60 ms of a 65 ms claim.
//
// Index scans only (no bitmap, no sequential scan where an index
// serves): a queue's statistics are usually out of date, and from
// statistics taken while the topic had a handful of ready rows the generic
// plan read the ready range through a bitmap and sorted it, every claim
// the whole backlog (50,000 rows, 50-75 ms a claim; a soak's consumer fell
// 45,000 messages behind); without bitmaps it took the rows to update by
// a sequential scan (a second per claim on a 30 MB outbox). Every table a
// claim reads has the index it needs: the ready index walked in its order,
// stopping at the limit, the primary key for the rows taken.
const ClaimSettings = `SELECT set_config('plan_cache_mode', 'force_generic_plan', true), ` + indexScansOnly

// indexScansOnly is what claims and writes share: no JIT, no bitmap, no
// sequential scan (see ClaimSettings and WriteSettings for why), and ISO
// dates and hex bytea: through the simple protocol (behind PgBouncer)
// timestamps and payloads travel as text in the session's DateStyle and
// bytea_output, and pgx reads ISO and hex only; a role's 'SQL, DMY' or
// 'escape' failed every claim, for good.
const indexScansOnly = `set_config('jit', 'off', true), set_config('enable_bitmapscan', 'off', true),
       set_config('enable_seqscan', 'off', true), set_config('DateStyle', 'ISO', true), set_config('bytea_output', 'hex', true)`

// WriteSettings sets what the subscriber's writes (acks, returns, dead
// letters, renewals) run with, local to their transaction: each finds its
// rows by primary key, one probe per row. A plan made while the outbox was
// small (a subscriber that starts on an empty outbox, a partition just
// created) is a hash join over a sequential scan, and as a prepared
// statement's plan it stays while the table grows, until the next ANALYZE:
// with autovacuum off, for good (TestWritePlansProbeByPrimaryKey).
const WriteSettings = `SELECT ` + indexScansOnly + `,
       set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true)`

// ClaimArgs are the parameters of a lease claim.
type ClaimArgs struct {
	Topic, Group string
	N            int         // rows to claim at most
	Token        pgtype.UUID // the claim's lease token
	LeaseUS      int64       // the lease, in microseconds
	WorkerID     string      // leased_by
	Holder       pgtype.Int8 // the claimer's liveness key, NULL when it holds none
	// The cursor: the last ready row a busy loop claimed (-infinity: from
	// the start).
	CursorAt pgtype.Timestamptz
	CursorID int64
	// ExpiredFrom: also reclaim the leases that ended from this time on
	// (-infinity: every expired lease; NULL: none).
	ExpiredFrom pgtype.Timestamptz
	Window      int      // ready rows the scan reads at most; 0: ClaimFast, no window
	EndedKeys   []string // with a window: ordering keys whose next rows to take
	Spare       []int64  // look for orphaned rows, sparing these liveness keys; nil: do not look
	Arrivals    int64    // with arrivals: take those after this id (the arrivals cursor)
	// Deadline: the claim takes nothing when the server starts it after
	// this time, by the server's clock (see inTime); NULL: no deadline.
	Deadline pgtype.Timestamptz
	// FreshOnly: lease only rows never delivered, and report whether a
	// row delivered before was passed over (see freshOnly).
	FreshOnly bool
}

// Lease returns the lease claim for a (ClaimFast without a window, Claim
// with one; each without the orphaned branch when a.Spare is nil) and its
// arguments in the statement's order.
func (q *ClaimStatements) Lease(a ClaimArgs) (string, []any) {
	args := []any{a.Topic, a.N, a.Token, a.LeaseUS, a.WorkerID, a.CursorAt, a.CursorID, a.ExpiredFrom, a.Holder, a.Group}
	var stmt string
	switch {
	case a.Window == 0 && a.Spare == nil:
		stmt = q.ClaimFastNoOrphans
	case a.Window == 0:
		stmt, args = q.ClaimFast, append(args, a.Spare)
	case a.Spare == nil:
		stmt, args = q.ClaimNoOrphans, append(args, a.Window, a.EndedKeys)
	default:
		stmt, args = q.Claim, append(args, a.Window, a.EndedKeys, a.Spare)
	}
	if q.arrivals {
		args = append(args, a.Arrivals)
	}
	return stmt, append(args, a.Deadline, a.FreshOnly)
}

// HeldArgs are the parameters of a held claim.
type HeldArgs struct {
	Topic, Group string
	N            int
	CursorAt     pgtype.Timestamptz
	CursorID     int64
	Arrivals     int64 // with arrivals: take those after this id
}

// Held returns HeldClaim's arguments in the statement's order.
func (q *ClaimStatements) Held(a HeldArgs) []any {
	args := []any{a.Topic, a.N, a.Group, a.CursorAt, a.CursorID}
	if q.arrivals {
		args = append(args, a.Arrivals)
	}
	return args
}
