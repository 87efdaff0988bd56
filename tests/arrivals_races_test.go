package tests

// Races of an outbox with arrivals (schema.Config.Arrivals) with bindings,
// fan-outs and held batches. A test on both layouts ("outbox" and
// "arrivals") holds the arrivals to what the single table does.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// layoutBundle is an outbox of the layout named ("outbox" or "arrivals").
func layoutBundle(t *testing.T, layout string) *bundle {
	if layout == "arrivals" {
		return setupArrivals(t)
	}
	return setup(t)
}

// A group bound with StartFromBacklog while the topic's only group holds
// an arrival on the held path gets that message too: the backlog copy
// reads the outbox, where the arrival is not, so the held batch's end
// gives the arrival its copies for the groups bound since (as the backlog
// copy gives the single table's held row one).
func TestArrivalsHeldWhileABacklogGroupBinds(t *testing.T) {
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			b := layoutBundle(t, layout)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			exec := tx.FromPgxPool(b.Pool)
			topic := "races-backlog-" + watermill.NewShortUUID()
			subA := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
				onPath(t, testhook.PathHeld, c)
				c.ConsumerGroup = "a"
				// The batch holds x until its ack, however long the Bind.
				id := c.WorkerID
				testhook.SetHeldBound(id, time.Minute)
				t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
			})
			chA, err := subA.Subscribe(ctx, topic)
			require.NoError(t, err)
			require.NoError(t, b.poolPublisher(t).Publish(topic, newMsg("x")))
			m := receive(t, chA, 10*time.Second)

			// While a's held batch holds it:
			_, err = pgoutbox.BindGroups(ctx, exec, b.tables, topic, []string{"b"}, pgoutbox.BindStartFrom(pgoutbox.StartFromBacklog))
			require.NoError(t, err)
			if layout == "arrivals" {
				require.Equal(t, 1, b.arrivals(t, topic), "x is still held where it arrived")
			}
			m.Ack()

			subB := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, testhook.PathLease, c); c.ConsumerGroup = "b" })
			chB, err := subB.Subscribe(ctx, topic)
			require.NoError(t, err)
			select {
			case got := <-chB:
				require.Equal(t, "x", string(got.Payload))
				got.Ack()
			case <-time.After(3 * time.Second):
				t.Fatalf("%s: group b, bound with StartFromBacklog while x waited in group a, never receives x "+
					"(arrivals left %d, outbox rows %d)", layout, b.arrivals(t, topic), b.outboxRows(t, topic))
			}
		})
	}
}

// Ordered subscriptions (MaxInFlight 1) of four groups hand out plain
// messages, published and committed in order before any subscriber
// started, in publish order, while their subscribers fan the arrivals out
// side by side: fan-outs of one topic run one at a time, so their copies
// get their ids, and commit, in the arrivals' order.
func TestArrivalsConcurrentFanOutsKeepPublishOrder(t *testing.T) {
	b := setupArrivals(t, pgoutboxtest.Options{MaxConns: 20})
	groups := []string{"g0", "g1", "g2", "g3"}
	for attempt := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		topic := fmt.Sprint("races-order-", attempt, "-", watermill.NewShortUUID())
		_, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, groups)
		require.NoError(t, err)
		const n = 2000
		pub := b.poolPublisher(t)
		for i := 0; i < n; i += 100 {
			msgs := newMsgs(100)
			for j, m := range msgs {
				m.Payload = []byte(strconv.Itoa(i + j))
			}
			require.NoError(t, pub.Publish(topic, msgs...))
		}
		var mu sync.Mutex
		var violations []string
		var wg sync.WaitGroup
		start := make(chan struct{})
		for _, g := range groups {
			sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = g })
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ch, err := sub.Subscribe(ctx, topic)
				if err != nil {
					mu.Lock()
					violations = append(violations, g+": "+err.Error())
					mu.Unlock()
					return
				}
				want := 0
				for want < n {
					select {
					case m := <-ch:
						got, _ := strconv.Atoi(string(m.Payload))
						m.Ack()
						if got != want {
							mu.Lock()
							violations = append(violations, fmt.Sprintf("%s: got %d, want %d", g, got, want))
							mu.Unlock()
							return
						}
						want++
					case <-time.After(10 * time.Second):
						mu.Lock()
						violations = append(violations, fmt.Sprintf("%s: stalled at %d", g, want))
						mu.Unlock()
						return
					}
				}
			}()
		}
		close(start)
		wg.Wait()
		cancel()
		require.Empty(t, violations, "attempt %d: ordered subscriptions of plain messages published in order", attempt)
	}
}

// The rename of a group (Bind new, Unbind old, MoveGroup old -> new) with
// a publish in flight: its transaction took the arrival's id before the
// new group's Bind and commits after the old group's Unbind, so no binding
// covers it. The next Bind of the topic (every Subscribe binds) adopts it
// for the groups bound, as the single table's unbound rows are adopted;
// on the single table the publish wrote a row of the old group, which
// MoveGroup hands to the new one.
func TestArrivalsPublishInFlightAcrossARename(t *testing.T) {
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			b := layoutBundle(t, layout)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			exec := tx.FromPgxPool(b.Pool)
			topic := "races-rename-" + watermill.NewShortUUID()
			require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, topic, "old"))

			ptx, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			p, err := pgoutbox.NewPublisher(tx.FromPgxTx(ptx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
			require.NoError(t, err)
			require.NoError(t, p.Publish(topic, newMsg("in flight")))

			// Bind in a transaction of its own: it does not wait for the
			// publishing transaction (it would, 10 s, on the default layout).
			btx, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxTx(btx), b.tables, topic, "new"))
			require.NoError(t, btx.Commit(ctx))
			_, err = pgoutbox.Unbind(ctx, exec, b.tables, topic, "old", false)
			require.NoError(t, err)
			require.NoError(t, ptx.Commit(ctx))
			_, err = pgoutbox.MoveGroup(ctx, exec, b.tables, topic, "old", "new")
			require.NoError(t, err)

			sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "new" })
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			select {
			case m := <-ch:
				require.Equal(t, "in flight", string(m.Payload))
				m.Ack()
			case <-time.After(3 * time.Second):
				stats, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForTopic(topic))
				require.NoError(t, err)
				t.Fatalf("%s: the message published during the rename reaches nobody (arrivals %d, outbox %d); stats: %+v",
					layout, b.arrivals(t, topic), b.outboxRows(t, topic), stats)
			}
		})
	}
}

// On a large arrivals table, the arrivals statements read the primary key
// (topic, id) or ctids, never the whole table, with custom and generic
// plans.
func TestArrivalsStatementsUseIndexes(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx := context.Background()
	_, err := b.Pool.Exec(ctx, fmt.Sprintf(`
INSERT INTO %[1]s.outbox_arrivals (topic, uuid, payload, metadata)
SELECT 'topic-' || (g %% 20), g::text, '\x00', '{}' FROM generate_series(1, 100000) g;
INSERT INTO %[1]s.outbox (topic, uuid, payload, metadata)
SELECT 'topic-' || (g %% 20), g::text, '\x00', '{}' FROM generate_series(1, 20000) g;
INSERT INTO %[1]s.outbox_bindings (topic, consumer_group, arrivals_from) VALUES ('topic-3', 'a', 0), ('topic-3', 'b', 50000);
ANALYZE %[1]s.outbox_arrivals; ANALYZE %[1]s.outbox; ANALYZE %[1]s.outbox_bindings`, b.Schema))
	require.NoError(t, err)
	names, err := query.NewNames(b.Schema, "outbox", "")
	require.NoError(t, err)
	names = names.WithArrivals()
	q := query.Build(names, true)
	lease := []any{"topic-3", 100, uuid.NewString(), int64(30e6), "test", fromStart, int64(0), fromStart, pgtype.Int8{Int64: 7, Valid: true}, "a"}
	sts := []claimStatement{
		{"windowed", q.Claim, append(append([]any{}, lease...), 256, []string{"k1"}, []int64{1, 2}, int64(0), nil, false)},
		{"fast", q.ClaimFast, append(append([]any{}, lease...), []int64{1, 2}, int64(0), nil, false)},
		{"fast-no-orphans", q.ClaimFastNoOrphans, append(append([]any{}, lease...), int64(0), nil, false)},
		{"held", q.HeldClaim, q.Held(query.HeldArgs{Topic: "topic-3", Group: "a", N: 100, CursorAt: fromStart})},
		{"transfer", q.Arrivals.Transfer, []any{"topic-3", "a", 256, "ch"}},
		{"settle", query.ArrivalsSettle(names), []any{"topic-3", "b", 5000, "ch"}},
		{"held-ack", q.Arrivals.HeldAck, []any{[]pgtype.TID{{BlockNumber: 1, OffsetNumber: 1, Valid: true}}, "topic-3", "a", "ch"}},
		{"held-finish", q.Arrivals.HeldFinish, []any{[]pgtype.TID{{BlockNumber: 1, OffsetNumber: 1, Valid: true}}, "topic-3", "a", "ch",
			[]pgtype.TID{{BlockNumber: 1, OffsetNumber: 2, Valid: true}}, uuid.NewString(), int64(30e6), "w", pgtype.Int8{}}},
		{"adopt", query.ArrivalsAdopt(names), []any{"topic-3", 5000, "ch"}},
		{"fast, fresh only", q.ClaimFast, append(append([]any{}, lease...), []int64{1, 2}, int64(0), nil, true)},
	}
	conn, err := b.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for i, st := range sts {
		// The claims and the held batch's end run with ClaimSettings (in
		// the claim's transaction); Transfer and ArrivalsSettle run as
		// plain statements, with custom plans, then maybe generic ones.
		settings := [][]string{{"SET LOCAL plan_cache_mode = force_custom_plan"}, {"SET LOCAL plan_cache_mode = force_generic_plan"}}
		if i < 4 || i == 6 || i == 7 || i == 9 {
			settings = [][]string{{query.ClaimSettings}}
		}
		for _, set := range settings {
			text := explainIn(t, conn, st, set...)
			if regexp.MustCompile(`Seq Scan on outbox_arrivals|Seq Scan on outbox( |$)`).MatchString(text) {
				t.Errorf("%s %v: a sequential scan:\n%s", st.name, set, text)
			}
		}
	}
}

// tx.Middleware on an outbox with arrivals, on each claim path: a held
// arrival becomes a lease in the outbox before the handler's transaction
// deletes it; every input is counted once, its output arrives, nothing is
// left.
func TestArrivalsWithTxMiddleware(t *testing.T) {
	b := setupArrivals(t)
	h := newTxHandlerBed(t, b.Pool, b)
	onEachClaimPath(t, func(t *testing.T, path string) {
		in, out := "races-txin-"+path+"-"+watermill.NewShortUUID(), "races-txout-"+path+"-"+watermill.NewShortUUID()
		sub := h.newSubscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c); c.MaxInFlight = 4 })
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddMiddleware(h.mw)
		var mu sync.Mutex
		seen := map[string]int{}
		r.AddHandler("count-"+path, in, sub, out, h.pub, func(m *message.Message) ([]*message.Message, error) {
			pgTx, ok := tx.PgxTxFromContext(m.Context())
			if !ok {
				return nil, fmt.Errorf("no transaction")
			}
			if _, err := pgTx.Exec(m.Context(), `SELECT 1`); err != nil {
				return nil, err
			}
			mu.Lock()
			seen[m.UUID]++
			mu.Unlock()
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out of "+string(m.Payload)))}, nil
		})
		startRouter(t, r)
		require.NoError(t, b.poolPublisher(t).Publish(in, newMsgs(30)...))
		require.Eventually(t, func() bool {
			return b.waiting(t, in) == 0 && b.arrivals(t, out) == 30
		}, 15*time.Second, 20*time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, seen, 30)
	})
}

// Fan-outs of one topic run one at a time: while one is under way (its
// transaction open), another subscriber's fan-out moves nothing, and an
// ordered subscription hands out the first message published first once
// the first fan-out commits.
func TestArrivalsFanOutsOfATopicRunOneAtATime(t *testing.T) {
	t.Parallel()
	b := setupArrivals(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	topic := "fanout-" + watermill.NewShortUUID()
	_, err := pgoutbox.BindGroups(ctx, tx.FromPgxPool(b.Pool), b.tables, topic, []string{"g0", "g1"})
	require.NoError(t, err)
	pub := b.poolPublisher(t)
	for i := 0; i < 512; i += 256 {
		msgs := newMsgs(256)
		for j, m := range msgs {
			m.Payload = []byte(strconv.Itoa(i + j))
		}
		require.NoError(t, pub.Publish(topic, msgs...))
	}
	names, err := query.NewNames(b.Schema, "outbox", "")
	require.NoError(t, err)
	q := query.Build(names.WithArrivals(), true)
	tx1, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx1.Rollback(ctx) }()
	// A Transfer runs after its TransferLock, in the same transaction.
	transfer := func(t2 pgx.Tx, group string) int64 {
		_, err := t2.Exec(ctx, q.Arrivals.TransferLock, topic)
		require.NoError(t, err)
		var moved, woken int64
		require.NoError(t, t2.QueryRow(ctx, q.Arrivals.Transfer, topic, group, 256, q.Names.Channel).Scan(&moved, &woken))
		return moved
	}
	require.EqualValues(t, 256, transfer(tx1, "g0"))
	tx2, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	require.Zero(t, transfer(tx2, "g1"), "a second fan-out of the topic waits for its turn")
	require.NoError(t, tx2.Rollback(ctx))

	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "g1" })
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, tx1.Commit(ctx))
	for i := range 512 {
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, strconv.Itoa(i), string(m.Payload), "publish order")
		m.Ack()
	}
}

// An ordered subscription of plain messages that nacks now and then hands
// them out in publish order on every claim mode. On the held path a lease
// claim (the look for expired leases, once a second) can run while a held
// batch of the subscription keeps earlier arrivals locked; it used to take
// the arrivals after them, and when an ordered nack in the batch gave its
// rows back, those, moved into the outbox, overtook the locked ones (in
// about one run in 200 of the held mode).
func TestArrivalsOrderedNacksKeepPublishOrder(t *testing.T) {
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		for i := range 8 {
			t.Run(strconv.Itoa(i), func(t *testing.T) {
				t.Parallel()
				b := setupArrivals(t)
				const n, topic = 60, "ledger"
				pub := b.poolPublisher(t)
				msgs := newMsgs(n)
				for i, m := range msgs {
					m.Payload = []byte(strconv.Itoa(i))
				}
				// Half before the subscriber starts, in one statement (one
				// claim locks many), half one by one while it runs.
				require.NoError(t, pub.Publish(topic, msgs[:n/2]...))
				var mu sync.Mutex
				var violations, trace []string
				next := 0
				done := make(chan struct{})
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					c.ClaimMode = mode // MaxInFlight 1: ordered
					c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 10 * time.Millisecond, MaxAttempts: pgoutbox.RetryForever}
				})
				rnd := rand.New(rand.NewPCG(uint64(i), 7))
				runRouter(t, sub, topic, func(msg *message.Message) error {
					mu.Lock()
					defer mu.Unlock()
					seq, _ := strconv.Atoi(string(msg.Payload))
					d, _ := pgoutbox.DeliveryOf(msg)
					trace = append(trace, fmt.Sprintf("%d#%d/%s", seq, d.Attempt, d.Path))
					if seq != next {
						violations = append(violations, fmt.Sprintf("got %d, want %d", seq, next))
					}
					if rnd.IntN(4) == 0 {
						return errors.New("nack")
					}
					if next = seq + 1; next == n {
						close(done)
					}
					return nil
				})
				for _, m := range msgs[n/2:] {
					require.NoError(t, pub.Publish(topic, m))
				}
				select {
				case <-done:
				case <-time.After(time.Minute):
				}
				mu.Lock()
				defer mu.Unlock()
				require.Empty(t, violations, "handed out (seq#attempt/path): %s", strings.Join(trace, " "))
				require.Equal(t, n, next, "every message acked")
			})
		}
	})
}
