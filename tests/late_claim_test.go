package tests

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// A lease claim that the network held back until its client had given up
// on it (and, after a Lease, on giving its rows back) takes nothing when
// it reaches the server at last: the path stops forwarding what the
// subscriber sends, a wake-up makes it claim, and the path delivers what
// it held later than the Lease and the StatementTimeout together. That
// claim would have leased the first row for a Lease under a token nobody
// holds, and the ordered subscription's next claims, answered, handed out
// the rows after it first. The hold covers claims only: the messages are
// published beside the proxy, and the wake-up reaches the subscriber.
// With arrivals, the claim would have moved the first arrival into the
// outbox as its lease.
func TestALeaseClaimTheNetworkHeldBackTakesNothing(t *testing.T) {
	t.Parallel()
	onEachLayout(t, leaseClaimHeldBack)
}

func leaseClaimHeldBack(t *testing.T, b *bundle) {
	px := startTCPProxy(t, b.DSN)
	pool := px.pool(t, b, "held-back-"+b.Schema, nil)
	ev := newEvents()
	const lease, statementTimeout = 2 * time.Second, 500 * time.Millisecond
	sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.Lease, c.StatementTimeout = pgoutbox.ClaimLease, lease, statementTimeout
		c.Observer = ev
	})
	seen := &list{}
	runRouter(t, sub, "t", func(m *message.Message) error {
		seen.add(string(m.Payload))
		return nil
	})
	waitEmptyClaim(t, ev) // the subscription has read the server's clock, and sleeps

	hold := lease + statementTimeout + 2*time.Second
	px.hold(hold)
	b.publishInTx(t, "t", true, newMsgs(10)...)
	pollUntil(t, "every message handled", hold+30*time.Second, nil, func() bool {
		return b.waiting(t, "t") == 0
	})
	got := seen.get()
	var first []string
	for _, p := range got {
		if !slices.Contains(first, p) {
			first = append(first, p)
		}
	}
	want := make([]string, 10)
	for i := range want {
		want[i] = fmt.Sprint(i)
	}
	require.Equal(t, want, first, "handed out in publish order: %v", got)
}

// A claim whose deadline came before the server started it, because a
// clock stepped since the clock was read (this machine's back, here by an
// hour), takes nothing and fails once, saying why; the next claim goes by
// the clocks as they are, and takes the message, delivered once. The
// first claim of a subscription has a deadline too (Subscribe reads the
// clock): it is the one refused, before the message is handed out.
func TestALeaseClaimLateByASteppedClockTakesNothingOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &lockedBuffer{}
	b.logger = watermill.NewStdLoggerWithOut(logs, false, false)
	ev := newEvents()
	id := "stepped-" + watermill.NewShortUUID()
	t.Cleanup(func() { testhook.TakeClockStep(id) })
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.ClaimMode, c.WorkerID, c.Observer = pgoutbox.ClaimLease, id, ev
	})
	refusals := func() int { return strings.Count(logs.String(), "after its deadline and took nothing") }
	testhook.StepClockOnce(id, time.Hour)
	b.publishInTx(t, "t", true, newMsg("before the first claim"))
	msgs, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	for i, want := range []string{"before the first claim", "after the step"} {
		if i > 0 {
			waitEmptyClaim(t, ev)
			testhook.StepClockOnce(id, time.Hour)
			b.publishInTx(t, "t", true, newMsg(want))
		}
		got := receive(t, msgs, 30*time.Second)
		require.Equal(t, want, string(got.Payload))
		require.Equal(t, i+1, refusals(), "the claim before it was refused: %s", logs.String())
		d, ok := pgoutbox.DeliveryOf(got)
		require.True(t, ok)
		require.Equal(t, 1, d.Attempt, "the late claim counted no delivery")
		got.Ack()
		require.Zero(t, testhook.TakeClockStep(id), "the step was taken")
	}
}

// Every lease claim variant (fast and windowed, each with and without the
// look for orphaned rows; on an outbox and with arrivals, whose claims
// move arrivals into the outbox) takes nothing past its deadline, and
// takes the row with a later one or none: the deadline is each variant's
// own last parameter (query.ClaimStatements.Lease), as the statement
// numbers it.
func TestEveryLeaseClaimVariantTakesNothingPastItsDeadline(t *testing.T) {
	t.Parallel()
	onEachLayout(t, func(t *testing.T, b *bundle) {
		names, err := query.NewNames(b.Schema, "outbox", "")
		require.NoError(t, err)
		if b.tables.Arrivals {
			names = names.WithArrivals()
		}
		q := query.Build(names, true)
		require.NoError(t, pgoutbox.Bind(context.Background(), tx.FromPgxPool(b.Pool), b.tables, "t", "g"))
		b.publishInTx(t, "t", true, newMsg("due"))
		conn, err := b.Pool.Acquire(context.Background())
		require.NoError(t, err)
		defer conn.Release()
		past := pgtype.Timestamptz{Time: time.Now().Add(-time.Hour), Valid: true}
		later := pgtype.Timestamptz{Time: time.Now().Add(time.Hour), Valid: true}
		for _, window := range []int{0, 256} {
			for _, spare := range [][]int64{nil, {1}} {
				for _, deadline := range []pgtype.Timestamptz{past, later, {}} {
					stmt, args := q.Lease(query.ClaimArgs{Topic: "t", Group: "g", N: 10, Token: pgtype.UUID{Bytes: uuid.New(), Valid: true},
						LeaseUS: 30e6, WorkerID: "test", CursorAt: fromStart, Window: window, EndedKeys: []string{}, Spare: spare, Deadline: deadline})
					took := rolledBackIn(t, conn, []string{query.ClaimSettings}, func() string {
						rows, err := conn.Query(context.Background(), stmt, args...)
						require.NoError(t, err)
						defer rows.Close()
						n := 0
						for rows.Next() {
							if id := rows.RawValues()[0]; id != nil {
								n++
							}
						}
						require.NoError(t, rows.Err())
						return fmt.Sprint(n)
					})
					want := "1"
					if deadline == past {
						want = "0"
					}
					require.Equal(t, want, took, "window %d, spare %v, deadline %v", window, spare, deadline)
				}
			}
		}
	})
}
