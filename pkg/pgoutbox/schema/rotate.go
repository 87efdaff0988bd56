package schema

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// RotateLockTimeout bounds how long Rotate's TRUNCATE of a drained partition
// waits for its lock. Every claim locks every partition, and claims queue
// behind a TRUNCATE that waits: this is the longest they stall. A TRUNCATE
// that times out is tried again at the next step.
const RotateLockTimeout = 50 * time.Millisecond

// DefaultRotationWindow is how long a partition of a rotating outbox takes
// the new rows before the ring advances (see Rotate). While a snapshot
// held elsewhere keeps vacuum from removing anything, the current
// partition keeps every row of its window, which claims step over: a
// shorter window keeps it smaller (in the soak benchmark, 2,000 msg/s
// under a held snapshot: a median window p99 of 11.9 ms with 3 s, 19.8 ms
// with 10 s), at the cost of a TRUNCATE, and its brief lock, every window.
const DefaultRotationWindow = 3 * time.Second

// ErrNotRotating is returned by Rotate for an outbox whose Config does not
// set Rotating.
var ErrNotRotating = errors.New("pgoutbox: the outbox is not rotating")

// RotateResult tells what one Rotate step did.
type RotateResult struct {
	// Busy: another session was rotating the outbox; this step did nothing.
	Busy bool
	// Current is the generation new rows go to after the step (0, 1 or 2).
	Current int
	// Advanced: the step made the next partition of the ring the current one.
	Advanced bool
	// Moved is the number of rows moved out of the ring, to the partition
	// vacuum looks after: rows due after the next window, and the rows of a
	// partition left undrained for three windows (at least 30 s).
	Moved int64
	// Truncated are the partitions the step emptied.
	Truncated []string
	// LockTimeouts counts the drained partitions whose TRUNCATE did not get
	// its lock within RotateLockTimeout (tried again next step).
	LockTimeouts int
}

// Rotate runs one step of a rotating outbox's rotation (Config.Rotating),
// in a READ COMMITTED transaction of its own, and reports what it did. The
// subscribers of a rotating outbox call it every fifth of
// SubscriberConfig.RotationWindow; call it yourself, from a scheduled job,
// when no subscriber runs. Several callers at once are safe: one rotates,
// the others return Busy. window 0 means DefaultRotationWindow.
//
// A step moves the rows of the two partitions the ring left that nothing
// holds and that are due after the next window (timers, retries backing
// off, parked rows) out of the ring. When the next partition of the ring
// still holds rows two windows after its turn came (and at least 30 s after
// the ring last advanced), those it can (nothing holds them, or their
// lease expired a minute ago) leave the ring too: a topic nobody consumes
// must not stop it. Then it truncates one drained
// partition, the next one first, which frees its space whatever snapshots
// are open, after checking again under its ACCESS EXCLUSIVE lock that no
// row was committed into it meanwhile; and once the next partition is
// empty and the current one took rows for a whole window (or took rows
// that are all consumed), the ring advances. While the next partition
// holds rows (a backlog), the ring waits: rows go on into the current
// partition, and nothing fails.
//
// TRUNCATE is not MVCC-safe: a transaction whose snapshot predates it sees
// the truncated partition empty. Only consumed rows are truncated.
func Rotate(ctx context.Context, db tx.Executor, c Config, window time.Duration) (RotateResult, error) {
	if err := checkExecutor(db); err != nil {
		return RotateResult{}, err
	}
	n, err := c.names()
	if err != nil {
		return RotateResult{}, err
	}
	if !n.Rotating {
		return RotateResult{}, fmt.Errorf("%w: set Config.Rotating for an outbox schema.Create made rotating", ErrNotRotating)
	}
	if db.InTx() {
		return RotateResult{}, errors.New("pgoutbox: rotate: pass a pool (tx.FromPgxPool, tx.FromSQLDB), not a transaction: a step commits on its own, so that the lock of a TRUNCATE is held for no longer than it takes")
	}
	if window == 0 {
		window = DefaultRotationWindow
	}
	if window < 0 {
		return RotateResult{}, fmt.Errorf("pgoutbox: rotate: window is %s; use a positive duration, or 0 for %s", window, DefaultRotationWindow)
	}
	q := query.Build(n, false).RotationStatements
	var res RotateResult
	err = tx.RunInTx(ctx, db, func(e tx.Executor) error {
		res = RotateResult{}
		// The check under the lock needs a snapshot of its own, whatever
		// default_transaction_isolation says.
		if _, err := e.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL READ COMMITTED`); err != nil {
			return err
		}
		var mine bool
		if err := scanOne(ctx, e, q.RotationLock, []any{n.QTable}, &mine); err != nil {
			return err
		}
		if !mine {
			res.Busy = true
			return nil
		}
		return rotateStep(ctx, e, q, n, window, &res)
	})
	if err != nil {
		if errtext.SQLState(err) == "42P01" && strings.Contains(err.Error(), n.Table+"_generation") {
			return RotateResult{}, fmt.Errorf("pgoutbox: rotate %s: it is a single table, not a rotating outbox (no sequence %s_generation); "+
				"unset Config.Rotating, or convert it first (schema.ConvertToRotating, pgoutbox schema convert-to-rotating): %w: %w", n.QTable, n.Table, ErrNotRotating, err)
		}
		return RotateResult{}, fmt.Errorf("pgoutbox: rotate %s: %w", n.QTable, err)
	}
	return res, nil
}

// minStuck is the least time the ring waits for a partition that does
// not drain before moving what is left in it out of the ring (see
// Rotate): three windows, and at least this.
const minStuck = 30 * time.Second

func stuckAfter(n query.Names) time.Duration {
	if d := testhook.RotateStuckAfter(n.QTable); d > 0 {
		return d
	}
	return minStuck
}

// moveBatch bounds the rows one statement of a step moves, so a step stays
// well inside a statement timeout; what is left moves at the next steps.
const moveBatch = 10000

// rotateStep is Rotate's work, in its transaction: the moves first, then
// at most one TRUNCATE and the advance, so that the TRUNCATE's lock, which
// every claim queues behind, is held only until the commit right after.
func rotateStep(ctx context.Context, e tx.Executor, q query.RotationStatements, n query.Names, window time.Duration, res *RotateResult) error {
	var cur int
	var ageMs int64
	if err := scanOne(ctx, e, q.Current, nil, &cur, &ageMs); err != nil {
		return err
	}
	res.Current = cur
	age := time.Duration(ageMs) * time.Millisecond
	next, prev := (cur+1)%query.RingSize, (cur+2)%query.RingSize
	for _, g := range []int{next, prev} {
		var moved int64
		if err := scanOne(ctx, e, q.MoveLater[g], []any{window.Seconds(), moveBatch}, &moved); err != nil {
			return fmt.Errorf("move the later rows of %s: %w", n.Generations[g], err)
		}
		res.Moved += moved
	}
	occupied := func(g int) (bool, error) {
		var any bool
		err := scanOne(ctx, e, q.Occupied[g], nil, &any)
		return any, err
	}
	nextBusy, err := occupied(next)
	if err != nil {
		return err
	}
	if nextBusy && age >= max(3*window, stuckAfter(n)) {
		// The ring has waited two windows (and at least half a minute)
		// for the next partition: what is left in it (a topic nobody
		// consumes, leases of a consumer that died) leaves the ring. Not
		// sooner: a backlog a deploy left behind drains where it is,
		// instead of being written again into the long partition.
		var moved int64
		if err := scanOne(ctx, e, q.MoveAll[next], []any{moveBatch}, &moved); err != nil {
			return fmt.Errorf("move the rows left in %s: %w", n.Generations[next], err)
		}
		res.Moved += moved
		if nextBusy, err = occupied(next); err != nil {
			return err
		}
	}
	// Before its window is over, the ring advances only from a partition
	// that took rows and holds none: its space can be freed at once.
	// Decided before the TRUNCATE, whose lock is held until the commit.
	mayAdvance := true
	if !nextBusy && age < window {
		busy, err := occupied(cur)
		if err != nil {
			return err
		}
		var size int64
		if !busy {
			if err := scanOne(ctx, e, q.Size[cur], nil, &size); err != nil {
				return err
			}
		}
		mayAdvance = !busy && size > 0
	}
	// At most one TRUNCATE a step: the next partition's, else the
	// previous one's (which is the next one after the advance).
	nextEmpty, tried := false, false
	if !nextBusy {
		if nextEmpty, tried, err = truncateGeneration(ctx, e, q, n, next, res); err != nil {
			return err
		}
	}
	if !tried {
		busy, err := occupied(prev)
		if err != nil {
			return err
		}
		if !busy {
			if _, _, err := truncateGeneration(ctx, e, q, n, prev, res); err != nil {
				return err
			}
		}
	}
	if !nextEmpty || !mayAdvance {
		return nil // the next partition still holds rows or kept its lock, or the current one's window goes on
	}
	if err := scanOne(ctx, e, q.Advance, []any{cur}, new(int64)); err != nil {
		return err
	}
	res.Advanced, res.Current = true, next
	return nil
}

// truncateGeneration empties partition g, which held no visible row: it
// reports whether g is empty on disk at the end (truncated now, or
// already), and whether it tried to truncate (g was not empty on disk). A
// lock it does not get within the lock timeout, or a row committed into g
// meanwhile, leaves g as it is.
func truncateGeneration(ctx context.Context, e tx.Executor, q query.RotationStatements, n query.Names, g int, res *RotateResult) (empty, tried bool, err error) {
	var size int64
	if err := scanOne(ctx, e, q.Size[g], nil, &size); err != nil || size == 0 {
		return err == nil, false, err // size 0: truncated already
	}
	empty, err = truncateNow(ctx, e, q, n, g, res)
	return empty, true, err
}

func truncateNow(ctx context.Context, e tx.Executor, q query.RotationStatements, n query.Names, g int, res *RotateResult) (bool, error) {
	// A savepoint, so that a lock timeout costs this truncation only, and
	// a partition found occupied under the lock is not kept locked.
	if _, err := e.Exec(ctx, `SAVEPOINT pgoutbox_truncate`); err != nil {
		return false, err
	}
	undo := func() error {
		_, err := e.Exec(ctx, `ROLLBACK TO SAVEPOINT pgoutbox_truncate`)
		return err
	}
	timeout := RotateLockTimeout
	if d := testhook.RotateLockTimeout(n.QTable); d > 0 {
		timeout = d
	}
	if _, err := e.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", timeout.Milliseconds())); err != nil {
		return false, err
	}
	// The lock, the look again under it (a publisher that read the
	// generation just before an advance may have committed into g since)
	// and the TRUNCATE, in one statement. The savepoint stays: the commit
	// that follows commits it, one round trip less under the lock.
	if _, err := e.Exec(ctx, q.TruncateIfEmpty[g]); err != nil {
		switch {
		case isLockTimeout(err):
			res.LockTimeouts++
			return false, undo()
		case errtext.SQLState(err) == "P0001" && strings.Contains(err.Error(), query.RotateOccupied):
			return false, undo()
		}
		return false, fmt.Errorf("truncate %s: %w", n.Generations[g], err)
	}
	res.Truncated = append(res.Truncated, n.Generations[g])
	return true, nil
}

// scanOne runs a statement that returns one row and scans it into dest.
// A statement that returns no row leaves dest as it is.
func scanOne(ctx context.Context, e tx.Executor, sql string, args []any, dest ...any) error {
	rows, err := e.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return err
		}
	}
	return rows.Err()
}
