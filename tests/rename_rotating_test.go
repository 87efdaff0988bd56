package tests

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// RenameGroup under traffic, six times in a row, on a rotating outbox
// while the ring rotates: a rotation step moving rows of the old name to
// the long partition held them locked, the move skipped them, and the
// rename reported success with rows left under the old name.
func TestRenamingAGroupWhileTheRingRotates(t *testing.T) {
	t.Parallel()
	for _, rotating := range []bool{false, true} {
		t.Run(fmt.Sprint("rotating=", rotating), func(t *testing.T) {
			t.Parallel()
			renameUnderRotation(t, rotating)
		})
	}
}

func renameUnderRotation(t *testing.T, rotating bool) {
	b := setup(t)
	if rotating {
		b = rotatingSetup(t)
	}
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"other", "g0"})
	require.NoError(t, err)
	published, stopTraffic := b.traffic(t, "t", 3)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if !rotating {
				return
			}
			if _, err := schema.Rotate(ctx, exec, b.tables, time.Microsecond); err != nil {
				t.Logf("rotation step: %v", err) // the next step retries, as the rotator does
			}
		}
	}()
	var renameErrs []string
	// g0 renamed g1, g1 renamed g2, …: each rename moves every row of
	// its old name, whatever the ring's steps hold for a moment.
	for i := range 6 {
		before := published.Load()
		pollUntil(t, "traffic", 20*time.Second, nil, func() bool { return published.Load() >= before+300 })
		from, to := fmt.Sprint("g", i), fmt.Sprint("g", i+1)
		if _, err := pgoutbox.RenameGroup(ctx, exec, b.tables, "t", from, to); err != nil {
			renameErrs = append(renameErrs, err.Error())
			_, err = pgoutbox.MoveGroup(ctx, exec, b.tables, "t", from, to)
			require.NoError(t, err)
		}
	}
	close(stop)
	wg.Wait()
	stopTraffic()
	total := int(published.Load())
	perGroup := func(group string) (rows, distinct int) {
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT uuid) FROM `+b.Schema+`.outbox WHERE topic = 't' AND consumer_group = $1`, group).Scan(&rows, &distinct))
		return rows, distinct
	}
	left := b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = 't' AND consumer_group NOT IN ('other', 'g6')`)
	rows, distinct := perGroup("g6")
	require.Empty(t, renameErrs)
	require.Zero(t, left, "nothing left under an old name")
	require.Equal(t, distinct, rows)
	require.Equal(t, total, rows)
	rows, _ = perGroup("other")
	require.Equal(t, total, rows)
}

// traffic publishes to topic from n goroutines, a message a call, until
// stop is called (it waits for them), and counts the publishes that
// committed.
func (b *bundle) traffic(t *testing.T, topic string, n int) (published *atomic.Int64, stop func()) {
	published = new(atomic.Int64)
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			if !assert.NoError(t, err) {
				return
			}
			for {
				select {
				case <-done:
					return
				default:
				}
				if assert.NoError(t, pub.Publish(topic, newMsg("x"))) {
					published.Add(1)
				}
			}
		}()
	}
	return published, func() { close(done); wg.Wait() }
}

// The operations on waiting rows of a rotating outbox, each while a
// rotation step is moving those rows out of the ring (a transaction that
// takes the rotator's lock and moves them to the long partition, as a step
// does, and commits once the operation waits): MoveGroup skipped the
// locked rows and reported a partial move as complete, RequeueParked the
// same, and Unbind's purge failed with "already moved to another
// partition". Each now waits for the step and does all of it. (Keyed
// rows, which CancelScheduled finds, live in the long partition and are
// never moved.)
func TestOperationsOnRowsARotationStepIsMoving(t *testing.T) {
	t.Parallel()
	const rows = 300
	ops := []struct {
		name string
		// mark makes the group's rows what the operation acts on.
		mark string
		run  func(ctx context.Context, b *bundle, exec tx.Executor, topic string) (int64, error)
		// left counts what the operation must leave none of.
		left string
	}{
		{"move", "", func(ctx context.Context, b *bundle, exec tx.Executor, topic string) (int64, error) {
			return pgoutbox.MoveGroup(ctx, exec, b.tables, topic, "a", "b")
		}, "consumer_group = 'a'"},
		{"unbind-purge", "", func(ctx context.Context, b *bundle, exec tx.Executor, topic string) (int64, error) {
			return pgoutbox.Unbind(ctx, exec, b.tables, topic, "a", true)
		}, "true"},
		{"requeue-parked", ", available_at = 'infinity', failure_reason = 'rejected'", func(ctx context.Context, b *bundle, exec tx.Executor, topic string) (int64, error) {
			return pgoutbox.RequeueParked(ctx, exec, b.tables, pgoutbox.ParkedFilter{Topic: topic})
		}, "available_at = 'infinity'"},
	}
	b := rotatingSetup(t)
	exec := tx.FromPgxPool(b.Pool)
	// The operations run under a role's defensive lock_timeout, which
	// their wait for the step ignores.
	opExec := tx.FromPgxPool(b.poolWith(t, map[string]string{"lock_timeout": "50ms"}, nil))
	for _, op := range ops {
		t.Run(op.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			topic := "moving-" + op.name
			_, err := pgoutbox.BindGroups(ctx, exec, b.tables, topic, []string{"a"})
			require.NoError(t, err)
			n := rows
			msgs := newMsgs(n)
			for _, m := range msgs {
				pgoutbox.DeliverAfter(m, time.Hour)
			}
			require.NoError(t, b.poolPublisher(t).Publish(topic, msgs...))
			if op.mark != "" {
				_, err = b.Pool.Exec(ctx, `UPDATE `+qtable(b.Schema)+` SET deliveries = deliveries`+op.mark+` WHERE topic = $1`, topic)
				require.NoError(t, err)
			}

			// The step: the rotator's lock, then the rows moved to the long
			// partition, uncommitted.
			step, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = step.Rollback(context.Background()) })
			_, err = step.Exec(ctx, query.RotationWait, qtable(b.Schema))
			require.NoError(t, err)
			var stepPID int
			require.NoError(t, step.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&stepPID))
			moved, err := step.Exec(ctx, fmt.Sprintf(`UPDATE %s SET generation = %d WHERE topic = $1 AND generation <> %[2]d`, qtable(b.Schema), query.LongGeneration), topic)
			require.NoError(t, err)
			require.EqualValues(t, n, moved.RowsAffected())

			type result struct {
				n   int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				n, err := op.run(ctx, b, opExec, topic)
				done <- result{n, err}
			}()
			// The operation waits for the step, or (as it did) returns at
			// once; either way the step commits after.
			var r result
			var returned bool
			pollUntil(t, "the operation waits for the step or returns", 10*time.Second, nil, func() bool {
				select {
				case r = <-done:
					returned = true
					return true
				default:
				}
				return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid)) AND now() - query_start > interval '200 milliseconds'`, stepPID) > 0
			})
			require.NoError(t, step.Commit(ctx))
			if !returned {
				r = <-done
			}
			require.NoError(t, r.err)
			require.EqualValues(t, n, r.n, "what the operation did")
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+qtable(b.Schema)+` WHERE topic = $1 AND `+op.left, topic), "rows left behind")
		})
	}
}
