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
