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

// RotationStatements are the rotator's (see schema.Rotate). Each step runs
// in one transaction under RotationLock.
type RotationStatements struct {
	// RotationLock: $1 the outbox's quoted name; true when this session
	// may rotate now (one rotator at a time per outbox).
	RotationLock string
	// LastGeneration: the sequence's last value (the current generation
	// is it modulo RingSize).
	LastGeneration string
	// Advance makes the next partition of the ring the current one.
	Advance string
	// MoveLater moves to the long partition the rows of partition $1 that
	// nothing holds and that are due after $2 seconds (timers, retries
	// backing off, parked rows); MoveAll, every row of it nothing holds,
	// ready ones too (a partition left with rows of a topic nobody
	// consumes). Both return the number of rows moved.
	MoveLater, MoveAll []string
	// Oldest: when partition g's first row (by id) was stored; no row
	// when it has none. One probe of its primary key.
	Oldest []string
	// Occupied: whether partition g holds a row (visible to the
	// statement's snapshot).
	Occupied []string
	// Size: partition g's size on disk; 0 once truncated.
	Size []string
	// LockGeneration takes partition g's ACCESS EXCLUSIVE lock (under the
	// step's lock_timeout), Truncate empties it.
	LockGeneration, Truncate []string
}

func buildRotation(n Names) RotationStatements {
	if !n.Rotating {
		return RotationStatements{}
	}
	r := RotationStatements{
		RotationLock:   `SELECT pg_try_advisory_xact_lock(hashtext('pgoutbox rotate ' || $1))`,
		LastGeneration: fmt.Sprintf(`SELECT pg_sequence_last_value('%s'::regclass)`, n.QGenSeq),
		Advance:        fmt.Sprintf(`SELECT nextval('%s'::regclass)`, n.QGenSeq),
	}
	for g := range LongGeneration + 1 {
		part := n.QGeneration(g)
		// SKIP LOCKED: a row a claim or a held batch has is left where it
		// is, and a claim never meets a row being moved under it (it
		// would fail: "already moved to another partition").
		move := func(cond string) string {
			return fmt.Sprintf(`
WITH moved AS (
    UPDATE %[1]s o SET generation = %[2]d
      FROM (SELECT id FROM %[3]s WHERE lease_token IS NULL%[4]s FOR UPDATE SKIP LOCKED) m
     WHERE o.id = m.id AND o.generation = %[5]d
    RETURNING 1
)
SELECT count(*) FROM moved`, n.QTable, LongGeneration, part, cond, g)
		}
		r.MoveLater = append(r.MoveLater, move(` AND available_at > now() + make_interval(secs => $1)`))
		r.MoveAll = append(r.MoveAll, move(""))
		r.Oldest = append(r.Oldest, fmt.Sprintf(`SELECT created_at FROM %s ORDER BY id LIMIT 1`, part))
		r.Occupied = append(r.Occupied, fmt.Sprintf(`SELECT EXISTS (SELECT FROM %s)`, part))
		r.Size = append(r.Size, fmt.Sprintf(`SELECT pg_relation_size('%s'::regclass)`, part))
		r.LockGeneration = append(r.LockGeneration, fmt.Sprintf(`LOCK TABLE %s IN ACCESS EXCLUSIVE MODE`, part))
		r.Truncate = append(r.Truncate, fmt.Sprintf(`TRUNCATE %s`, part))
	}
	return r
}
