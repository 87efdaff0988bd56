package schema

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

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
// the new rows before the ring advances (see Rotate).
const DefaultRotationWindow = 10 * time.Second

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
	// partition left undrained for three windows.
	Moved int64
	// Truncated are the partitions the step emptied.
	Truncated []string
	// LockTimeouts counts the drained partitions whose TRUNCATE did not get
	// its lock within RotateLockTimeout (tried again next step).
	LockTimeouts int
}

// Rotate runs one step of a rotating outbox's rotation (Config.Rotating),
// in a transaction of its own, and reports what it did. The subscribers of
// a rotating outbox call it every window/5 (SubscriberConfig.RotationWindow);
// call it yourself, from a scheduled job, when no subscriber runs. Several
// callers at once are safe: one rotates, the others return Busy. window 0
// means DefaultRotationWindow.
//
// A step, for each partition of the ring other than the current one, oldest
// first: it moves the rows nothing holds that are due after the next window
// (timers, retries backing off, parked rows) out of the ring, and all rows
// nothing holds once the partition is three windows old (a topic nobody
// consumes must not stop the ring); a partition with no row left is
// truncated, which frees its space whatever snapshots are open, after
// checking again, under its ACCESS EXCLUSIVE lock, that no row was
// committed into it meanwhile. Then, if the next partition of the ring is
// empty and the current one took rows for a whole window, the ring
// advances. If the next partition still holds rows (a backlog), the ring
// waits: rows go on into the current partition, and nothing fails.
//
// TRUNCATE is not MVCC-safe: a transaction whose snapshot predates it sees
// the truncated partition empty. Only consumed rows are truncated.
func Rotate(ctx context.Context, db tx.Executor, c Config, window time.Duration) (RotateResult, error) {
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
		var mine bool
		if err := scanOne(ctx, e, q.RotationLock, []any{n.QTable}, &mine); err != nil {
			return err
		}
		if !mine {
			res.Busy = true
			return nil
		}
		var last int64
		if err := scanOne(ctx, e, q.LastGeneration, nil, &last); err != nil {
			return err
		}
		cur := int(last % query.RingSize)
		res.Current = cur
		nextEmpty := false
		for k := 1; k < query.RingSize; k++ {
			g := (cur + k) % query.RingSize
			empty, err := drainGeneration(ctx, e, q, n, g, window, &res)
			if err != nil {
				return err
			}
			if k == 1 {
				nextEmpty = empty
			}
		}
		if !nextEmpty {
			return nil
		}
		// Advance once the current partition's first row is a window
		// old, or once it took rows and holds none: all consumed, its
		// space can be freed at once.
		var since pgtype.Timestamptz
		if err := scanOne(ctx, e, q.Oldest[cur], nil, &since); err != nil {
			return err
		}
		if since.Valid && time.Since(since.Time) < window {
			return nil
		}
		if !since.Valid {
			var size int64
			if err := scanOne(ctx, e, q.Size[cur], nil, &size); err != nil || size == 0 {
				return err // nothing stored yet
			}
		}
		if err := scanOne(ctx, e, q.Advance, nil, &last); err != nil {
			return err
		}
		res.Advanced, res.Current = true, int(last%query.RingSize)
		return nil
	})
	if err != nil {
		return RotateResult{}, fmt.Errorf("pgoutbox: rotate %s: %w", n.QTable, err)
	}
	return res, nil
}

// drainGeneration moves what must leave partition g and truncates it when
// nothing is left; it reports whether g is empty at the end.
func drainGeneration(ctx context.Context, e tx.Executor, q query.RotationStatements, n query.Names, g int, window time.Duration, res *RotateResult) (bool, error) {
	var moved int64
	if err := scanOne(ctx, e, q.MoveLater[g], []any{window.Seconds()}, &moved); err != nil {
		return false, fmt.Errorf("move the later rows of %s: %w", n.Generations[g], err)
	}
	res.Moved += moved
	var since pgtype.Timestamptz
	if err := scanOne(ctx, e, q.Oldest[g], nil, &since); err != nil {
		return false, err
	}
	if since.Valid && time.Since(since.Time) > 3*window {
		if err := scanOne(ctx, e, q.MoveAll[g], nil, &moved); err != nil {
			return false, fmt.Errorf("move the rows left in %s: %w", n.Generations[g], err)
		}
		res.Moved += moved
	}
	var occupied bool
	if err := scanOne(ctx, e, q.Occupied[g], nil, &occupied); err != nil || occupied {
		return false, err
	}
	var size int64
	if err := scanOne(ctx, e, q.Size[g], nil, &size); err != nil || size == 0 {
		return err == nil, err // size 0: truncated already
	}
	// A savepoint, so that a lock timeout costs this truncation only.
	if _, err := e.Exec(ctx, `SAVEPOINT pgoutbox_truncate`); err != nil {
		return false, err
	}
	truncated, err := func() (bool, error) {
		timeout := RotateLockTimeout
		if d := testhook.RotateLockTimeout(); d > 0 {
			timeout = d
		}
		if _, err := e.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", timeout.Milliseconds())); err != nil {
			return false, err
		}
		if _, err := e.Exec(ctx, q.LockGeneration[g]); err != nil {
			return false, err
		}
		// Again under the lock, with a fresh snapshot (READ COMMITTED): a
		// publisher that read the generation just before an advance may
		// have committed into g since.
		var again bool
		if err := scanOne(ctx, e, q.Occupied[g], nil, &again); err != nil || again {
			return false, err
		}
		_, err := e.Exec(ctx, q.Truncate[g])
		return err == nil, err
	}()
	switch {
	case isLockTimeout(err):
		res.LockTimeouts++
		_, err = e.Exec(ctx, `ROLLBACK TO SAVEPOINT pgoutbox_truncate`)
		return false, err
	case err != nil:
		return false, fmt.Errorf("truncate %s: %w", n.Generations[g], err)
	}
	if _, err := e.Exec(ctx, `RELEASE SAVEPOINT pgoutbox_truncate`); err != nil {
		return false, err
	}
	if truncated {
		res.Truncated = append(res.Truncated, n.Generations[g])
	}
	return truncated, nil
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
