package query

import (
	"fmt"
	"slices"
	"sort"

	"github.com/jackc/pgx/v5/pgtype"
)

// CompleteStatements write what handlers decided: acks, returns, holds
// (Complete, or Ack alone), dead letters, renewals, a handler's own
// completion (CompleteInTx) and the end of a held batch.
type CompleteStatements struct {
	Complete     string
	Ack          string
	CompleteInTx string
	HeldAck      string
	HeldFinish   string
	Dead         string
	Renew        string
	Present      string
}

func buildComplete(n Names, ac string) CompleteStatements {
	t := n.QTable
	return CompleteStatements{
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
		// a handler. err and meta NULL keep the stored values. Holds ($9..$12,
		// $16) keep the lease of a nacked row that an ordered subscription
		// will deliver again itself, and bring its delivery count up to the
		// count the subscription expects ($16), adding one at most: the
		// nack's hold expects the count it has (nothing added), the hold
		// written as the retry goes out one more; a hold written again after
		// its reply was lost (it committed) does not count twice.
		//
		// A return that makes a row due wakes the idle subscribers of the
		// topic and group (NOTIFY $14 with the payload GroupMark || $15,
		// where $15 is topic GroupMark group; a row due later sends
		// ScheduleMark || $15). The row it adds to the result has id 0.
		Complete: fmt.Sprintf(`
WITH acked AS (
    DELETE FROM %[1]s o
     USING unnest($1::bigint[], $2::uuid[]) AS c(id, token)
     WHERE `+underToken+`%[2]s
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
     WHERE `+underToken+`%[2]s
    RETURNING o.id, c.token, o.available_at <= now() AS due
), held AS (
    UPDATE %[1]s o
       SET deliveries   = CASE WHEN o.deliveries >= c.counted THEN o.deliveries ELSE o.deliveries + 1 END,
           leased_until = now() + $13::bigint * interval '1 microsecond',
           last_error   = coalesce(c.err, o.last_error),
           metadata     = coalesce(c.meta::jsonb, o.metadata)
      FROM unnest($9::bigint[], $10::uuid[], $11::text[], $12::text[], $16::int[]) AS c(id, token, err, meta, counted)
     WHERE `+underToken+`%[2]s
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
		//
		// It is one walk of the primary key, probed with the ids as an
		// index condition, and each row's token is compared with the one
		// paired with its id. Write sorts the pairs by id, so the pair is
		// found by a binary search (width_bucket over the sorted ids: the
		// id is in the array, so its bucket is its position); a linear
		// search (array_position) made an ack quadratic in its size, 0.9 ms
		// instead of 0.4 ms at 250 rows (tests/bench/sql/ack-shapes.sql).
		// A batch whose ids repeat goes through Complete instead. No join,
		// so no plan can take a whole index as its outer side: while a
		// snapshot holds vacuum back, the statistics count a million index
		// entries for a thousand live rows, and a join of the pairs with
		// the outbox walked the whole primary key (0.4-1 s an ack in the
		// blocked soak). Pairs, not any token of the batch: the
		// subscription may hold the row again under a newer token (its
		// lease expired and came back to it), and an ack of the older
		// delivery must not end the newer one. A row updated while the ack
		// waits for its lock (a lease taken over, a row moved to another
		// group) is checked again on its new version by the same
		// conditions. The coalesce keeps "lease_token IS NOT NULL" from
		// being implied, which would let the planner walk the lease index
		// (see underToken).
		Ack: fmt.Sprintf(`
DELETE FROM %[1]s o
 WHERE o.id = ANY ($1::bigint[])
   AND coalesce(o.lease_token, '00000000-0000-0000-0000-000000000000') = ($2::uuid[])[width_bucket(o.id, $1::bigint[])]%[2]s
RETURNING o.id, o.lease_token`, t, ac),

		// CompleteInTx deletes a delivered row in the transaction of the
		// handler that processed it (tx.Middleware), under its lease token:
		// 0 rows means the lease was lost and the transaction must roll
		// back. No asynchronous-commit clause: that transaction commits
		// the handler's own writes, with the user's durability. It runs
		// with the user's settings, so its shape alone must keep it on the
		// primary key: "lease_token = $2" would imply the lease index's
		// predicate, and with statistics saying few leases the generic
		// plan walked that whole index for the row (see underToken).
		CompleteInTx: fmt.Sprintf(`DELETE FROM %s WHERE id = $1 AND coalesce(lease_token, '00000000-0000-0000-0000-000000000000') = $2`, t),

		// HeldAck deletes the acked rows of a held claim, in its
		// transaction: the locks make a token unnecessary.
		HeldAck: fmt.Sprintf(`DELETE FROM %s WHERE id = ANY ($1::bigint[])`, t),

		// HeldFinish is HeldAck plus the rows of the held claim that leave
		// it without an ack (a handler still running at the bound, a nack,
		// a dead letter): they become ordinary leases under token $3,
		// counting their delivery, before the transaction commits. Their
		// nacks and dead letters are then written like any lease's. The
		// lease runs from this statement, not from the held transaction's
		// start: a lease must be written ending in the future, or a look
		// for expired leases that starts after its end misses it.
		HeldFinish: fmt.Sprintf(`
WITH acked AS (
    DELETE FROM %[1]s WHERE id = ANY ($1::bigint[])
)
UPDATE %[1]s
   SET lease_token  = $3::uuid,
       leased_until = statement_timestamp() + $4::bigint * interval '1 microsecond',
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
		// Present reads which of the rows $1 are still in the outbox: an
		// ack that missed its row (its lease token matched nothing) tells
		// a row another consumer holds, or that is due again, from one
		// that is gone.
		Present: fmt.Sprintf(`SELECT id FROM %s WHERE id = ANY ($1::bigint[])`, t),

		// Renew extends the leases of held rows, under their tokens, and
		// stamps them with the holder's current liveness key ($4, NULL when
		// it holds none): a process that had to take a new key must not
		// leave rows under its old one, which looks dead.
		Renew: fmt.Sprintf(`
UPDATE %[1]s o
   SET leased_until = now() + $3::bigint * interval '1 microsecond',
       lease_holder = $4::bigint
  FROM unnest($1::bigint[], $2::uuid[]) AS c(id, token)
 WHERE `+underToken+`%[2]s
RETURNING o.id, c.token`, t, ac),
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
 WHERE `+underToken+`%[2]s
RETURNING o.id, c.token`, n.QTable, ac)
	}
	// The INSERT runs although nothing reads its result: PostgreSQL always
	// executes data-modifying CTEs, and a failure fails the whole statement.
	return fmt.Sprintf(`WITH dead AS (
    DELETE FROM %[1]s o
     USING unnest($1::bigint[], $2::uuid[], $3::text[], $4::text[]) AS c(id, token, reason, err)
     WHERE `+underToken+`%[2]s
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

// CompleteArgs are the parameters of a batch of acks, returns and holds,
// each a set of parallel arrays.
type CompleteArgs struct {
	AckIDs    []int64
	AckTokens Tokens
	// Returns give rows back: due again after DelayUS (NULL: keep
	// available_at), Undo 1 takes back a delivery nobody saw, Errs and
	// Metas NULL keep what is stored.
	RetIDs    []int64
	RetTokens Tokens
	DelayUS   []pgtype.Int8
	Undo      []int32
	Errs      []pgtype.Text
	Metas     []pgtype.Text
	// Holds keep a nacked row's lease (ordered mode) and bring its count
	// up to HoldCounts (see Complete).
	HoldIDs    []int64
	HoldTokens Tokens
	HoldErrs   []pgtype.Text
	HoldMetas  []pgtype.Text
	HoldCounts []int32 // the deliveries a row has once its hold counted: a hold written twice counts once
	LeaseUS    int64   // the lease a hold extends
	Channel    string  // the NOTIFY channel of returned rows
	WakeKey    string  // topic GroupMark group: who wakes
}

// Write returns the statement for a (Ack when it holds acks alone) and
// its arguments in the statement's order. It sorts a's acks by id in
// place, each with its token, as Ack needs.
func (q *CompleteStatements) Write(a CompleteArgs) (string, []any) {
	if len(a.RetIDs) == 0 && len(a.HoldIDs) == 0 && sortPairs(a.AckIDs, a.AckTokens) {
		return q.Ack, []any{a.AckIDs, a.AckTokens}
	}
	return q.Complete, []any{a.AckIDs, a.AckTokens,
		a.RetIDs, a.RetTokens, a.DelayUS, a.Undo, a.Errs, a.Metas,
		a.HoldIDs, a.HoldTokens, a.HoldErrs, a.HoldMetas, a.LeaseUS,
		a.Channel, a.WakeKey, a.HoldCounts}
}

// FinishArgs are the parameters of HeldFinish.
type FinishArgs struct {
	AckIDs   []int64
	LeaseIDs []int64     // rows that become leases
	Token    pgtype.UUID // their lease token
	LeaseUS  int64
	WorkerID string
	Holder   pgtype.Int8
}

// Finish returns HeldFinish's arguments in the statement's order.
func (a FinishArgs) Finish() []any {
	return []any{a.AckIDs, a.LeaseIDs, a.Token, a.LeaseUS, a.WorkerID, a.Holder}
}

// Tokens is an array parameter of lease tokens. Its elements are pointers
// (to the tokens the deliveries hold): pgx boxes each element of an array
// parameter into an interface, which allocates for a 16-byte value and not
// for a pointer, and a batch of acks is thousands of tokens a second.
type Tokens = pgtype.FlatArray[*pgtype.UUID]

// underToken is how a write finds its rows: by id, still under the token
// the caller holds (c, an unnest of ids and tokens). The token is compared
// with IS NOT DISTINCT FROM (the tokens are never NULL) because "=" implies
// lease_token IS NOT NULL, which lets the planner take the lease index's
// partial predicate for granted and walk that whole index for the rows:
// with the statistics saying few leases, it did, and under a held snapshot
// the index is mostly dead entries (0.4 s an ack in the blocked soak).
const underToken = "o.id = c.id AND o.lease_token IS NOT DISTINCT FROM c.token AND c.token IS NOT NULL"

// sortPairs sorts ids ascending, moving each token with its id, and
// reports whether no id repeats. Ack pairs each row with the token at its
// id's position in the sorted ids; a row acked twice in one batch (once
// under a lease that expired, once under the one that took it back) needs
// Complete's join, which tries every pair.
func sortPairs(ids []int64, tokens Tokens) bool {
	if !slices.IsSorted(ids) {
		sort.Sort(pairs{ids, tokens})
	}
	for i := 1; i < len(ids); i++ {
		if ids[i] == ids[i-1] {
			return false
		}
	}
	return true
}

// pairs sorts ids and their tokens together.
type pairs struct {
	ids    []int64
	tokens Tokens
}

func (p pairs) Len() int           { return len(p.ids) }
func (p pairs) Less(i, j int) bool { return p.ids[i] < p.ids[j] }
func (p pairs) Swap(i, j int) {
	p.ids[i], p.ids[j] = p.ids[j], p.ids[i]
	p.tokens[i], p.tokens[j] = p.tokens[j], p.tokens[i]
}
