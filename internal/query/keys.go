package query

import "fmt"

// KeyClass is the first key of the advisory locks that mark an ordering key
// as taken ("pgok" in ASCII, beside LivenessClass's "pgob").
const KeyClass = 0x70676f6b

// Why ordering keys need more than keyIsFree: a claim decides from its
// statement's snapshot, and two rows of one key can each look free to a
// different claim. A late-committing row (lower id) appears after a later
// row of its key was taken; a held row is locked, not leased, so nothing
// committed says its key is busy; and a competitor's lease is invisible
// until its claim commits. So every claim that takes keyed rows first makes
// its claim known (a lease claim commits; a held claim locks each key with
// pg_try_advisory_xact_lock until its transaction ends), then looks again
// with a newer snapshot (KeyVerifyLease, KeyVerifyHeld) and gives back the
// rows whose key turned out busy. Of two claims of one key, the one that
// looks last sees the other. TestOrderingKey* run this on each claim path.
// Both steps run only when a claim took keyed rows.

// keyLock takes the key lock of row's ordering key in topic $1 and group
// group, or reports that another session holds it. It is taken only for
// rows a claim is about to return: a lock per candidate would fill the
// server's lock table.
func keyLock(n Names, row, group string) string {
	return fmt.Sprintf(`pg_try_advisory_xact_lock(%d, hashtext('%s' || chr(30) || $1 || chr(30) || %s || chr(30) || %s.ordering_key))`,
		KeyClass, n.QTable, group, row)
}

// keyTaken is true when row's key has an older row present (parked rows
// aside) or another row leased: the committed facts that make a key busy.
//
// The older row is looked for with olderOfKey, a condition only the
// ordering-key index can serve (see there).
func keyTaken(t, row, group string) string {
	return fmt.Sprintf(`(EXISTS (
        SELECT 1 FROM %[1]s k
         WHERE k.topic = $1 AND k.consumer_group = %[3]s AND k.ordering_key = %[2]s.ordering_key
           AND %[4]s AND k.available_at < 'infinity')
     OR EXISTS (
        SELECT 1 FROM %[1]s l
         WHERE l.topic = $1 AND l.consumer_group = %[3]s AND l.ordering_key = %[2]s.ordering_key
           AND l.lease_token IS NOT NULL AND l.id <> %[2]s.id))`, t, row, group, olderOfKey("k", row+".ordering_key", row+".id"))
}

// olderOfKey is "row alias of key key with an id below id", written as a
// row comparison on (ordering_key, id): two adjacent columns of the
// ordering-key index, and no condition the primary key can use. With
// "id < id" the planner may walk the primary key from its start and
// filter for the key: statistics taken while the outbox held a backlog of
// a few keys (autovacuum's ANALYZE) make a key look like half the table,
// so the first row of it seems a few rows away. For a key whose rows come
// after the others' it is not: every claim's probe per row read the whole
// table before them (9 s a claim, a keyed backlog of 23,000 rows; claims
// ran out of their StatementTimeout and a retried row behind the backlog
// was never reached).
//
// A NOT EXISTS of it is written with OFFSET 0, which keeps it a subplan
// run per row with that row's id in its index condition. Pulled up into
// an anti join, the planner may scan the key's rows once per outer row and
// compare the ids as a join filter: finding a key's first row then read
// every row of the key (130 ms a claim, a backlog of 10,000 rows a key on
// a table not yet analyzed; 3 keys drained at 74 messages a second).
func olderOfKey(alias, key, id string) string {
	return fmt.Sprintf(`(%[1]s.ordering_key, %[1]s.id) < (%[2]s, %[3]s)`, alias, key, id)
}

// keyIsFree is the ordering-key condition of every claim, for the row
// aliased row of topic $1 and group group, as far as the claim's snapshot
// tells: an unkeyed row, or one whose key has no older row present and no
// leased row (a row committed late may have a higher id than a leased one
// of its key). The claim's verification settles the rest (see above).
func keyIsFree(t, row, group string) string {
	return fmt.Sprintf(`(%[2]s.ordering_key IS NULL OR NOT %[1]s)`, keyTaken(t, row, group), row)
}

// keyVerifyLease gives back the keyed rows $2 just claimed under token $3
// (topic $1, group $4) whose key is busy after all: taken by a committed
// fact, or locked by a held claim. Run after the claim committed; its
// delivery is taken back. Returns the ids given back. The token and the
// key are compared so that neither implies a partial index's predicate:
// the rows are found by their ids only (see underToken).
func keyVerifyLease(n Names, ac string) string {
	t := n.QTable
	return fmt.Sprintf(`
UPDATE %[1]s o
   SET lease_token = NULL, leased_until = NULL, leased_by = NULL, lease_holder = NULL,
       deliveries = o.deliveries - 1
 WHERE o.id = ANY ($2::bigint[]) AND coalesce(o.lease_token, '00000000-0000-0000-0000-000000000000') = $3::uuid
   AND num_nulls(o.ordering_key) = 0
   AND CASE WHEN %[2]s THEN true ELSE NOT %[3]s END%[4]s
RETURNING o.id`, t, keyTaken(t, "o", "$4"), keyLock(n, "o", "$4"), ac)
}

// keyLockHeld takes the key locks of the keyed rows $2 of a held claim
// (topic $1, group $3), in its transaction, until it ends, and returns the
// rows whose lock another session holds. It runs after the claim, not in
// it: a lock taken in the claim's own scan could be taken for rows it then
// skips, and the claim's plan stays the fast one.
func keyLockHeld(n Names) string {
	return fmt.Sprintf(`
SELECT o.id FROM %[1]s o
 WHERE o.id = ANY ($2::bigint[])
   AND CASE WHEN o.ordering_key IS NULL THEN false ELSE NOT %[2]s END`, n.QTable, keyLock(n, "o", "$3"))
}

// keyVerifyHeld returns the held rows $2 (topic $1, group $3) whose key is
// busy after all, run in the held transaction after the claim took their
// key locks: no other claim can take those keys now, so only committed
// facts remain to check.
func keyVerifyHeld(n Names) string {
	t := n.QTable
	return fmt.Sprintf(`
SELECT o.id FROM %[1]s o
 WHERE o.id = ANY ($2::bigint[]) AND o.ordering_key IS NOT NULL AND %[2]s`, t, keyTaken(t, "o", "$3"))
}
