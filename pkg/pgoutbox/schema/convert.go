package schema

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// ConvertToRotating turns an existing single-table outbox into a rotating
// one (Config.Rotating; see docs/rotation.md), keeping every row, id,
// lease, dedup key and grant. The single table becomes the ring's long
// partition, which vacuum looks after as before; new rows go into the
// ring. Nothing is copied, so the time it takes does not grow with the
// backlog, except for what runs without blocking anyone: two indexes built
// concurrently and a check of every row. It takes the table's ACCESS
// EXCLUSIVE lock twice, for catalog changes only: to add the generation
// column, and for the swap. Each time it waits at most DDLLockTimeout for
// the transactions using the outbox (publishers and consumers wait behind
// it meanwhile), and then fails, saying so: run it again.
//
// Run it as the outbox's owner, with a pool (not a transaction: concurrent
// index builds cannot run in one). It is idempotent: an outbox that is
// rotating already is left as it is, and a conversion interrupted part way
// goes on from where it stopped. The single table must have pgoutbox's
// latest layout (Migrate or Create first) and no columns of your own (a
// partition has its table's columns and no others); your own indexes stay
// on the long partition.
//
// A rotating outbox has no arrivals table (Config.Arrivals): an empty one
// is dropped in the swap, one that holds messages is refused. Unset
// Arrivals in every publisher first.
//
// Afterwards, set Rotating in every publisher's and subscriber's Config
// and restart them. Until then, processes that run with the single
// table's setting go on consuming and publishing plain messages, but
// their keyed, scheduled and ordered publishes, dead-letter requeues and
// bindings of new consumer groups fail (their statements name a conflict
// target the dedup index, which now holds the generation, no longer
// matches, and the ring's partitions refuse keyed rows), and nothing
// rotates.
//
// The partitioned table, its sequence and the ring's partitions get the
// single table's owner. The roles granted privileges on the single table
// get the same on the partitioned table, and what a rotating outbox needs
// of them besides: SELECT on the generation sequence for those that may
// insert (every insert reads it), SELECT (generation) for those that may
// read dedup_key, and for those that may delete (consumers, who run the
// rotation) SELECT and UPDATE on the sequence and SELECT, UPDATE and
// TRUNCATE on the ring's partitions. Row security policies and publications of the single table
// stay on it, the long partition: recreate them on the outbox.
func ConvertToRotating(ctx context.Context, db tx.Executor, c Config) error {
	if err := checkExecutor(db); err != nil {
		return err
	}
	c.Rotating, c.Arrivals = false, false
	single, err := c.names()
	if err != nil {
		return err
	}
	if p := query.RingNameProblem(single); p != "" {
		return fmt.Errorf("%w: convert %s to a rotating outbox: %s", ErrInvalidName, single.QTable, p)
	}
	// A rotating outbox has no arrivals (Config.Arrivals): its
	// subscribers would never take what the arrivals table holds. An
	// empty one (every single table has it) goes in the swap.
	arrivals := single.WithArrivals()
	if cols, err := catalog(ctx, db, query.CatalogColumns, arrivals.Schema, arrivals.ArrivalsTable, 2); err != nil {
		return err
	} else if len(cols) > 0 {
		var held bool
		if err := scanOne(ctx, db, query.ArrivalsHeld(single), nil, &held); err != nil {
			return err
		}
		if held {
			return fmt.Errorf("pgoutbox: convert %s to a rotating outbox: its arrivals table (%s) holds messages; a rotating outbox takes every message into its ring: "+
				"unset Arrivals in every publisher, let the subscribers take what it holds, unset it in every subscriber, then convert", single.QTable, arrivals.QArrivals)
		}
	}
	n := single.Rotated()
	if p, err := takenNamesProblem(ctx, db, n); err != nil || p != "" {
		if err == nil {
			err = fmt.Errorf("%w: convert %s to a rotating outbox: %s", ErrInvalidName, single.QTable, p)
		}
		return err
	}
	if err := convert(ctx, db, c, single, n); err != nil {
		return fmt.Errorf("pgoutbox: convert %s to a rotating outbox: %w", n.QTable, err)
	}
	return nil
}

func convert(ctx context.Context, db tx.Executor, c Config, single, n query.Names) error {
	if db.InTx() {
		return errors.New("pass a pool (tx.FromPgxPool, tx.FromSQLDB), not a transaction: the indexes are built concurrently, which a transaction cannot do")
	}
	exists, converted, err := outboxLayout(ctx, db, n)
	switch {
	case err != nil:
		return err
	case !exists:
		return fmt.Errorf("table %s.%s does not exist; create a rotating outbox with schema.Create and Config.Rotating set", n.Schema, n.Table)
	case converted:
		return nil
	}
	var ve *ValidationError
	if err := Validate(ctx, db, c); errors.As(err, &ve) {
		return fmt.Errorf("the single table is not at pgoutbox's latest layout; run schema.Migrate or schema.Create (pgoutbox schema migrate up) first: %s", strings.Join(ve.Problems, "; "))
	} else if err != nil {
		return err
	}
	q := query.Conversion(n)
	foreign, err := queryStrings(ctx, db, q.ForeignColumns)
	if err != nil {
		return err
	}
	if len(foreign) > 0 {
		return fmt.Errorf("the outbox has columns pgoutbox does not know (%s), which a partition cannot have; drop them or keep that data in a table of its own, then convert", strings.Join(foreign, ", "))
	}

	rotating := func() (bool, error) {
		_, rotating, err := outboxLayout(ctx, db, n)
		return rotating, err
	}
	// What takes long first, none of it blocking publishers or consumers
	// for more than a catalog change. Each step does nothing to an outbox
	// another conversion finished meanwhile.
	if err := convertTx(ctx, db, single, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, q.Prepare); err != nil {
			return ddlError(q.Prepare, err)
		}
		return nil
	}); err != nil {
		return err
	}
	if err := buildConcurrently(ctx, db, n.QTable, q.Building, q.IndexState, q.Prepared, q.PreparedNames, q.DropIndex,
		func() (bool, error) { return rotating() }); err != nil {
		return err
	}
	if done, err := rotating(); err != nil || done {
		return err
	}
	if _, err := db.Exec(ctx, q.ValidateCheck); err != nil {
		return ddlError(q.ValidateCheck, err)
	}

	// The swap, in one transaction under the table's lock.
	return convertTx(ctx, db, single, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, q.Lock); err != nil {
			return ddlError(q.Lock, err)
		}
		if _, converted, err := outboxLayout(ctx, e, n); err != nil || converted {
			return err // converted: another conversion finished while this one waited
		}
		var next int64
		if err := scanOne(ctx, e, q.NextID, nil, &next); err != nil {
			return err
		}
		stmts := []string{query.DropEmptyArrivals(single), q.Release}
		stmts = append(stmts, query.DDL(n)...)
		stmts = append(stmts, q.RestartID(next))
		for _, stmt := range stmts {
			if _, err := e.Exec(ctx, stmt); err != nil {
				return ddlError(stmt, err)
			}
		}
		unmatched, err := queryStrings(ctx, e, q.Unmatched)
		if err != nil {
			return err
		}
		if len(unmatched) > 0 {
			return fmt.Errorf("the single table has no index of the definition of %s (an index of pgoutbox's name was changed?), which attaching would build under the table's lock; recreate it as schema.SQL has it (nothing was changed)", strings.Join(unmatched, ", "))
		}
		for _, stmt := range []string{q.Attach, q.DropCheck, q.Handover} {
			if _, err := e.Exec(ctx, stmt); err != nil {
				return ddlError(stmt, err)
			}
		}
		rc := c
		rc.Rotating = true
		var ve *ValidationError
		if err := Validate(ctx, e, rc); errors.As(err, &ve) {
			return fmt.Errorf("the converted outbox does not validate (nothing was changed): %s", strings.Join(ve.Problems, "; "))
		} else if err != nil {
			return err
		}
		return nil
	})
}

// IsRotating reports whether the outbox c names exists and is rotating
// (made by Create with Config.Rotating, or by ConvertToRotating), whatever
// c.Rotating says: tools that act on an outbox someone else made use it
// to pick the setting.
func IsRotating(ctx context.Context, db tx.Executor, c Config) (bool, error) {
	if err := checkExecutor(db); err != nil {
		return false, err
	}
	n, err := c.names()
	if err != nil {
		return false, err
	}
	_, rotating, err := outboxLayout(ctx, db, n)
	return rotating, err
}

// queryStrings returns the first column of every row of sql, as text.
func queryStrings(ctx context.Context, e tx.Executor, sql string, args ...any) ([]string, error) {
	rows, err := queryRows(ctx, e, 1, sql, args...)
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = r[0]
	}
	return out, err
}

// convertTx is inLockedTx with a lock_timeout of DDLLockTimeout, whatever
// the session's: every publisher and consumer queues behind a waiting
// ACCESS EXCLUSIVE request.
func convertTx(ctx context.Context, db tx.Executor, n query.Names, fn func(e tx.Executor) error) error {
	return inLockedTx(ctx, db, n, func(e tx.Executor, _ lockWait) error {
		if _, err := e.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", DDLLockTimeout.Milliseconds())); err != nil {
			return err
		}
		return fn(e)
	})
}

// buildConcurrently builds a conversion's indexes with CREATE INDEX
// CONCURRENTLY, one at a time, dropping one a failed build left invalid
// and refusing while another build runs on the table (building). It
// stops, without error, once done reports that another conversion
// finished.
func buildConcurrently(ctx context.Context, db tx.Executor, table, building, state string, build, names, drop []string, done func() (bool, error)) error {
	for i, name := range names {
		valid, err := queryStrings(ctx, db, state, name)
		if err != nil {
			return err
		}
		if len(valid) == 1 && valid[0] != "true" {
			// A concurrent build that failed leaves an invalid index
			// behind; one still running (another conversion's) looks the
			// same until it is done.
			var running bool
			if err := scanOne(ctx, db, building, nil, &running); err != nil {
				return err
			}
			if running {
				return fmt.Errorf("an index is being built on %s (another conversion?); run this again once it is done (see pg_stat_progress_create_index)", table)
			}
			if _, err := db.Exec(ctx, drop[i]); err != nil {
				return ddlError(drop[i], err)
			}
		}
		if finished, err := done(); err != nil || finished {
			return err
		}
		if _, err := db.Exec(ctx, build[i]); err != nil {
			return ddlError(build[i], err)
		}
	}
	return nil
}

// ConvertToSingle turns a rotating outbox back into a single table (see
// docs/rotation.md), keeping every row, id, lease, dedup key and grant:
// the long partition becomes the table. It first stops the ring taking
// plain inserts, moves the ring's rows into the long partition in batches
// that skip rows a claim holds, and builds the single table's primary key
// on id and its dedup index concurrently; then, under the partitioned
// table's ACCESS EXCLUSIVE lock, it moves what is left in the ring,
// detaches the long partition, drops the partitioned table with the ring
// and the generation sequence, and gives the long partition the outbox's
// name, index names and identity (ids go on from the rotating outbox's).
// Your own indexes on the outbox are kept, with their names. Each lock
// waits at most DDLLockTimeout for the transactions using the outbox and
// then fails, saying so: run it again.
//
// Run it as the outbox's owner, with a pool (not a transaction). It is
// idempotent: a single table is left as it is, and a conversion
// interrupted part way goes on from where it stopped. The rotating outbox
// must have pgoutbox's latest layout, and no index of yours may hold the
// generation column (it would go with the column: ConvertToSingle
// refuses, naming it).
//
// The single table keeps the long partition's owner and gets the grants
// of the partitioned table (column grants on the generation aside). Row
// security policies and publications of the partitioned table are
// dropped with it: recreate them on the single table.
//
// Afterwards, unset Rotating in every publisher's and subscriber's Config
// and restart them. Until then, processes that run with the rotating
// setting go on consuming and publishing plain messages, but their keyed,
// scheduled and ordered publishes, dead-letter requeues and bindings of
// new consumer groups fail (their statements name the generation column),
// and so does their rotation step, logged at every step.
func ConvertToSingle(ctx context.Context, db tx.Executor, c Config) error {
	if err := checkExecutor(db); err != nil {
		return err
	}
	c.Rotating = false
	single, err := c.names()
	if err != nil {
		return err
	}
	n := single.Rotated()
	if err := convertBack(ctx, db, c, single, n); err != nil {
		return fmt.Errorf("pgoutbox: convert %s to a single table: %w", n.QTable, err)
	}
	return nil
}

func convertBack(ctx context.Context, db tx.Executor, c Config, single, n query.Names) error {
	if db.InTx() {
		return errors.New("pass a pool (tx.FromPgxPool, tx.FromSQLDB), not a transaction: the indexes are built concurrently, which a transaction cannot do")
	}
	rotating := func() (bool, error) {
		exists, rotating, err := outboxLayout(ctx, db, n)
		if err == nil && !exists {
			err = fmt.Errorf("table %s.%s does not exist; create a single-table outbox with schema.Create", n.Schema, n.Table)
		}
		return rotating, err
	}
	switch rot, err := rotating(); {
	case err != nil:
		return err
	case !rot:
		return nil
	}
	rc := c
	rc.Rotating = true
	var ve *ValidationError
	if err := Validate(ctx, db, rc); errors.As(err, &ve) {
		return fmt.Errorf("the rotating outbox is not at pgoutbox's latest layout; run schema.Create with Config.Rotating set first: %s", strings.Join(ve.Problems, "; "))
	} else if err != nil {
		return err
	}
	q := query.SingleConversion(n, single)
	if held, err := queryStrings(ctx, db, q.GenerationIndexes); err != nil {
		return err
	} else if len(held) > 0 {
		return fmt.Errorf("indexes %s hold the generation column, which a single table does not have, and would be dropped with it: drop them, or create them again without the generation, then run this again", strings.Join(held, ", "))
	}

	// What takes long first, none of it blocking publishers or consumers
	// for more than a catalog change.
	if err := convertTx(ctx, db, single, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, q.StopRing); err != nil {
			return ddlError(q.StopRing, err)
		}
		return nil
	}); err != nil {
		return err
	}
	if err := moveOut(ctx, db, q.MoveOut); err != nil {
		return err
	}
	done := func() (bool, error) {
		rot, err := rotating()
		return !rot, err
	}
	if err := buildConcurrently(ctx, db, n.QGeneration(query.LongGeneration), q.Building, q.IndexState, q.Prepared, q.PreparedNames, q.DropIndex, done); err != nil {
		return err
	}
	// Processes with the rotating setting went on writing keyed,
	// scheduled and ordered rows into the ring while the indexes were
	// built: fewer rows to move under the lock.
	if err := moveOut(ctx, db, q.MoveOut); err != nil {
		return err
	}

	// The swap, in one transaction under the partitioned table's lock.
	return convertTx(ctx, db, single, func(e tx.Executor) error {
		if _, err := e.Exec(ctx, q.RotationLock, n.QTable); err != nil {
			return ddlError(q.RotationLock, err)
		}
		if _, err := e.Exec(ctx, q.Lock); err != nil {
			return ddlError(q.Lock, err)
		}
		if _, rot, err := outboxLayout(ctx, e, n); err != nil || !rot {
			return err // another conversion finished while this one waited
		}
		var next int64
		if err := scanOne(ctx, e, q.NextID, nil, &next); err != nil {
			return err
		}
		// A stray arrivals table (the versioned migrations' version 7 run
		// on the rotating outbox by an older build) would hold the ring's
		// sequence in its id default: it goes first, and Create's comes
		// after the swap.
		for _, stmt := range append([]string{query.DropEmptyArrivals(single), q.MoveAll, q.Swap(next)}, query.ArrivalsDDL(single)...) {
			if _, err := e.Exec(ctx, stmt); err != nil {
				return ddlError(stmt, err)
			}
		}
		var ve *ValidationError
		if err := Validate(ctx, e, c); errors.As(err, &ve) {
			return fmt.Errorf("the single table does not validate (nothing was changed): %s", strings.Join(ve.Problems, "; "))
		} else if err != nil {
			return err
		}
		return nil
	})
}

// moveOut runs each ring partition's move until a batch comes back short:
// what keeps arriving, or a claim holds, is moved under the swap's lock.
// A batch that met a row moved by a rotation step since its snapshot
// (serialization failure) is tried again.
func moveOut(ctx context.Context, db tx.Executor, moves []string) error {
	for _, move := range moves {
		for failures := 0; ; {
			var moved int64
			err := scanOne(ctx, db, move, nil, &moved)
			if isSerializationFailure(err) && failures < 10 {
				failures++
				select {
				case <-time.After(time.Duration(failures) * 10 * time.Millisecond):
				case <-ctx.Done():
					return ctx.Err()
				}
				continue
			}
			if err != nil {
				return fmt.Errorf("move the ring's rows into the long partition: %w", err)
			}
			if moved < query.MoveBatch {
				break
			}
		}
	}
	return nil
}
