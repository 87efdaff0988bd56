package query

import "fmt"

// A rotating outbox is a table partitioned by its generation column:
// RingSize partitions that take the new rows in turn and are emptied by
// TRUNCATE once drained (which frees their space whatever snapshots are
// open, where DELETE and VACUUM cannot while one is held), and a partition
// outside the ring (LongGeneration) for the rows that outlive a turn of it:
// keyed rows (a unique index of a partitioned table must hold the
// partition key, so dedup keys are unique only if all keyed rows share one
// generation), and the timers, retries and stuck rows the rotator moves
// there. Vacuum looks after that one as it does after a single table.
const (
	// RingSize is the number of partitions in the ring: the one written,
	// the one draining, and an empty one to advance into.
	RingSize = 3
	// LongGeneration is the generation of the partition outside the ring.
	LongGeneration = 3
)

// Rotated returns n for a rotating outbox.
func (n Names) Rotated() Names {
	n.Rotating = true
	n.GenSeq = derive(n.Table, "_generation")
	n.QGenSeq = n.QSchema + "." + Quote(n.GenSeq)
	n.Generations = make([]string, LongGeneration+1)
	for g := range RingSize {
		n.Generations[g] = derive(n.Table, fmt.Sprintf("_g%d", g))
	}
	n.Generations[LongGeneration] = derive(n.Table, "_long")
	return n
}

// QGeneration is the quoted name of generation g's partition.
func (n Names) QGeneration(g int) string { return n.QSchema + "." + Quote(n.Generations[g]) }

// currentGeneration is the generation new rows go to: the sequence's last
// value (readable by every session, about a microsecond) modulo the ring.
// A row therefore always has a partition: when nothing rotates, every row
// goes on into the current one.
func (n Names) currentGeneration() string {
	return fmt.Sprintf(`(pg_sequence_last_value('%s'::regclass) %% %d)::smallint`, n.QGenSeq, RingSize)
}

// generationColumn is what an INSERT that may carry a dedup key adds to its
// column list and to its values: nothing for a single table; for a
// rotating one, LongGeneration for keyed rows and the current generation
// for the others. dedupKey is the expression of the row's key.
func (n Names) generationColumn(dedupKey string) (column, value string) {
	if !n.Rotating {
		return "", ""
	}
	return ", generation", fmt.Sprintf(", CASE WHEN %s IS NOT NULL THEN %d ELSE %s END", dedupKey, LongGeneration, n.currentGeneration())
}

// dedupConflict is the ON CONFLICT target of a keyed insert: the dedup
// index's columns.
func (n Names) dedupConflict() string {
	if n.Rotating {
		return "(topic, consumer_group, dedup_key, generation) WHERE dedup_key IS NOT NULL"
	}
	return "(topic, consumer_group, dedup_key) WHERE dedup_key IS NOT NULL"
}

// The generation sequence holds two things in one value: the current
// generation (the value modulo RingSize, which is all a row's default
// reads) and when it became current (the value divided by RingSize, in
// milliseconds since the epoch). The rotator advances it with setval,
// which is written to the WAL as it is (nextval logs values ahead, and
// after a crash would jump to an arbitrary generation).
func (n Names) seqAt(when, generation string) string {
	return fmt.Sprintf(`(floor(extract(epoch FROM %s) * 1000)::bigint * %d + (%s))`, when, RingSize, generation)
}

// RotationStatements are the rotator's (see schema.Rotate).
type RotationStatements struct {
	// RotationLock: $1 the outbox's quoted name; true when this session
	// may rotate now (one rotator at a time per outbox).
	RotationLock string
	// Current: the current generation and how many milliseconds ago it
	// became current (by the database's clock).
	Current string
	// Advance makes the generation after $1 the current one, from now.
	Advance string
	// MoveLater moves to the long partition at most $2 rows of partition
	// g that nothing holds and that are due after $1 seconds (timers,
	// retries backing off, parked rows); MoveAll, at most $1 rows of it
	// that nothing holds or whose lease expired a minute ago, ready ones
	// too (a partition left with rows of a topic nobody consumes, or by a
	// consumer that died). Both return the number of rows moved. A claim
	// whose snapshot still has such a row fails on it ("already moved to
	// another partition") and is retried; only rows nobody could take now
	// (later ones) move while the ring turns, all of them only when it is
	// stuck.
	MoveLater, MoveAll []string
	// Occupied: whether partition g holds a row (visible to the
	// statement's snapshot).
	Occupied []string
	// Size: partition g's size on disk; 0 once truncated.
	Size []string
	// TruncateIfEmpty empties partition g in one statement: it takes the
	// partition's ACCESS EXCLUSIVE lock (under the step's lock_timeout),
	// looks again, with a snapshot taken under the lock, for a row a
	// publisher committed into it meanwhile (raising RotateOccupied if
	// it finds one), and truncates it. One round trip under the lock,
	// where a statement each took three: every claim and ack of the
	// outbox queues behind that lock, and a round trip on a busy machine
	// is tens of milliseconds.
	TruncateIfEmpty []string
	// RingHealth: the ring's state for Health (see ringHealth).
	RingHealth string
}

// RotateOccupied is the message of the error TruncateIfEmpty raises when
// the partition holds a row under its lock.
const RotateOccupied = "pgoutbox: the partition holds a row committed since it was found empty"

// RotationWait ($1 the outbox's quoted name) waits for the rotation step
// under way, if any, and keeps the next from starting until the
// transaction ends (the steps only try the lock): for the operations on
// waiting rows (MoveGroup, a purge, a requeue of parked rows),
// whose statements would skip the rows a step is moving (SKIP LOCKED) or
// fail on them ("already moved to another partition").
//
// Like TopicLock, the wait ignores a role's lock_timeout (put back after).
var RotationWait = pastLockTimeout(`pg_advisory_xact_lock(` + rotationLockKey + `)`)

// rotationLockKey is the advisory lock that makes one rotation step at a
// time per outbox, $1 the outbox's quoted name: rotation steps try it,
// the conversion back waits for it.
const rotationLockKey = `hashtext('pgoutbox rotate ' || $1)`

func buildRotation(n Names) RotationStatements {
	if !n.Rotating {
		return RotationStatements{}
	}
	r := RotationStatements{
		RotationLock: `SELECT pg_try_advisory_xact_lock(` + rotationLockKey + `)`,
		Current: fmt.Sprintf(`SELECT (v %% %[2]d)::int, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - v / %[2]d
  FROM pg_sequence_last_value('%[1]s'::regclass) AS v`, n.QGenSeq, RingSize),
		Advance:    fmt.Sprintf(`SELECT setval('%s'::regclass, %s, true)`, n.QGenSeq, n.seqAt("clock_timestamp()", fmt.Sprintf("($1::int + 1) %% %d", RingSize))),
		RingHealth: ringHealth(n),
	}
	for g := range LongGeneration + 1 {
		part := n.QGeneration(g)
		// SKIP LOCKED: a row a claim or a held batch has is left where it
		// is (held rows have no lease, but their batch locks them).
		move := func(cond, limit string) string {
			return fmt.Sprintf(`
WITH moved AS (
    UPDATE %[1]s o SET generation = %[2]d
      FROM (SELECT id FROM %[3]s WHERE %[4]s LIMIT %[6]s FOR UPDATE SKIP LOCKED) m
     WHERE o.id = m.id AND o.generation = %[5]d
    RETURNING 1
)
SELECT count(*) FROM moved`, n.QTable, LongGeneration, part, cond, g, limit)
		}
		r.MoveLater = append(r.MoveLater, move(`lease_token IS NULL AND available_at > now() + make_interval(secs => $1)`, "$2"))
		r.MoveAll = append(r.MoveAll, move(`(lease_token IS NULL OR leased_until < now() - interval '1 minute')`, "$1"))
		r.Occupied = append(r.Occupied, fmt.Sprintf(`SELECT EXISTS (SELECT FROM %s)`, part))
		r.Size = append(r.Size, fmt.Sprintf(`SELECT pg_relation_size('%s'::regclass)`, part))
		r.TruncateIfEmpty = append(r.TruncateIfEmpty, fmt.Sprintf(`DO $pgoutbox$
BEGIN
    LOCK TABLE %[1]s IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT FROM %[1]s) THEN
        RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = '%[2]s';
    END IF;
    TRUNCATE %[1]s;
END
$pgoutbox$`, part, RotateOccupied))
	}
	return r
}
