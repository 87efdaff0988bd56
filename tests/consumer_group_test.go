package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func (b *bundle) groupSubscriber(t *testing.T, group string, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	return b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.ConsumerGroup = group
		if mod != nil {
			mod(c)
		}
	})
}

// handledSet counts handlings per message UUID, safely from handlers.
type handledSet struct {
	mu sync.Mutex
	n  map[string]int
}

func newHandledSet() *handledSet { return &handledSet{n: map[string]int{}} }

func (h *handledSet) add(uuid string) {
	h.mu.Lock()
	h.n[uuid]++
	h.mu.Unlock()
}

func (h *handledSet) distinct() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.n)
}

func (h *handledSet) has(uuid string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n[uuid] > 0
}

// Two groups with three competing subscribers each, 2,000 messages, random
// nacks: each group handles every message at least once, and nothing is
// left pending.
func TestConsumerGroupsEachGetEveryMessage(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	const n = 2000
	groups := []string{"billing", "shipping"}
	handled := map[string]*handledSet{}
	for _, g := range groups {
		handled[g] = newHandledSet()
		for range 3 { // competing within the group
			sub := b.groupSubscriber(t, g, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 4 })
			seen := handled[g]
			runRouter(t, sub, "orders", func(m *message.Message) error {
				if rand.IntN(20) == 0 {
					return errors.New("random failure") // nacked, comes back
				}
				seen.add(m.UUID)
				return nil
			})
		}
	}
	// The groups are bound (their subscribers subscribed): publish now.
	for _, g := range groups {
		pollUntil(t, "group "+g+" bound", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE topic = 'orders' AND consumer_group = $1`, g) == 1
		})
	}
	pub := b.poolPublisher(t)
	msgs := newMsgs(n)
	for i := 0; i < n; i += 100 {
		require.NoError(t, pub.Publish("orders", msgs[i:i+100]...))
	}
	for _, g := range groups {
		pollUntil(t, "group "+g+" handled every message", 60*time.Second, nil, func() bool { return handled[g].distinct() == n })
		for _, m := range msgs {
			require.True(t, handled[g].has(m.UUID))
		}
	}
	pollUntil(t, "nothing pending", 20*time.Second, nil, func() bool { return b.outboxRows(t, "orders") == 0 })
}

// Watermill's CQRS event processor builds one subscriber per handler, with
// the handler name as the consumer group: three handlers of one event each
// see every event (before groups they shared them).
func TestCQRSEventHandlersEachSeeEveryEvent(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	type RoomBooked struct {
		Room string `json:"room"`
	}
	marshaler := cqrs.JSONMarshaler{}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	processor, err := cqrs.NewEventProcessorWithConfig(r, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) {
			return "events." + p.EventName, nil
		},
		SubscriberConstructor: func(p cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
				Tables:          b.tables,
				ConsumerGroup:   p.HandlerName,
				MinPollInterval: 20 * time.Millisecond,
				MaxPollInterval: time.Second,
			}, nil)
		},
		Marshaler: marshaler,
	})
	require.NoError(t, err)
	const n = 30
	counts := make([]atomic.Int32, 3)
	for i := range counts {
		require.NoError(t, processor.AddHandlers(cqrs.NewEventHandler(fmt.Sprintf("handler-%d", i),
			func(ctx context.Context, e *RoomBooked) error {
				counts[i].Add(1)
				return nil
			})))
	}
	startRouter(t, r)
	for i := range counts {
		name := fmt.Sprintf("handler-%d", i)
		pollUntil(t, name+" bound", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE consumer_group = $1`, name) == 1
		})
	}
	bus, err := cqrs.NewEventBusWithConfig(b.poolPublisher(t), cqrs.EventBusConfig{
		GeneratePublishTopic: func(p cqrs.GenerateEventPublishTopicParams) (string, error) {
			return "events." + p.EventName, nil
		},
		Marshaler: marshaler,
	})
	require.NoError(t, err)
	for i := range n {
		require.NoError(t, bus.Publish(context.Background(), &RoomBooked{Room: fmt.Sprint(i)}))
	}
	for i := range counts {
		pollUntil(t, fmt.Sprintf("handler-%d saw every event", i), 30*time.Second, nil, func() bool { return counts[i].Load() >= n })
	}
}

// A failing, slow group does not delay another: while group "stuck" has a
// hung handler and retries, group "fast" handles every message promptly.
func TestAStuckGroupDoesNotDelayAnother(t *testing.T) {
	t.Parallel()
	b := setup(t)
	release := make(chan struct{})
	defer close(release)
	stuck := b.groupSubscriber(t, "stuck", func(c *pgoutbox.SubscriberConfig) { c.AckDeadline = -1; c.DrainTimeout = -1 })
	runRouter(t, stuck, "t", func(m *message.Message) error {
		if string(m.Payload) == "0" {
			<-release // hung
		}
		return errors.New("always failing")
	})
	fast := b.groupSubscriber(t, "fast", nil)
	var latencies []time.Duration
	var mu sync.Mutex
	published := map[string]time.Time{}
	runRouter(t, fast, "t", func(m *message.Message) error {
		mu.Lock()
		latencies = append(latencies, time.Since(published[m.UUID]))
		mu.Unlock()
		return nil
	})
	for _, g := range []string{"stuck", "fast"} {
		pollUntil(t, "group "+g+" bound", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE consumer_group = $1`, g) == 1
		})
	}
	pub := b.poolPublisher(t)
	for i := range 50 {
		m := newMsg(fmt.Sprint(i))
		mu.Lock()
		published[m.UUID] = time.Now()
		mu.Unlock()
		require.NoError(t, pub.Publish("t", m))
	}
	pollUntil(t, "the fast group handled all", 20*time.Second, nil, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(latencies) >= 50
	})
	mu.Lock()
	worst := time.Duration(0)
	for _, l := range latencies {
		worst = max(worst, l)
	}
	mu.Unlock()
	t.Logf("fast group: 50 messages, worst commit-to-handler latency %s while the other group is stuck", worst.Round(time.Millisecond))
	require.Equal(t, 50, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = 'stuck'`),
		"the stuck group's copies are all still there")
}

// A message published before anybody bound the topic waits, unbound,
// for the first group to bind (here a named one); a subscriber without a
// group that binds later starts at new messages, like any later group.
func TestMessageBeforeAnyBindingGoesToTheFirstGroup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	early := newMsg("early")
	b.publishInTx(t, "t", true, early)

	logs := &logCapture{}
	first, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: "first", MaxPollInterval: 200 * time.Millisecond}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = first.Close() })
	firstGroup, err := first.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	got := receive(t, firstGroup, 10*time.Second)
	require.Equal(t, early.UUID, got.UUID, "the first group to bind gets what was published before")
	got.Ack()
	said := logs.find("info", func(e logEntry) bool { return strings.Contains(e.msg, "a group that binds later gets none of them") })
	require.Len(t, said, 1, "the first group says it took them, where a second group's owner may look")
	require.Equal(t, int64(1), said[0].fields["adopted"])

	def, err := b.subscriber(t, nil).Subscribe(context.Background(), "t")
	require.NoError(t, err)
	later := newMsg("later")
	b.publishInTx(t, "t", true, later)
	got = receive(t, def, 10*time.Second)
	require.Equal(t, later.UUID, got.UUID)
	got.Ack()
	got = receive(t, firstGroup, 10*time.Second)
	require.Equal(t, later.UUID, got.UUID)
	got.Ack()
}

// Bind from a deploy step: a group bound before its first subscriber runs
// keeps every message published meanwhile. Unbind stops the copies, and
// with purge deletes the ones waiting.
func TestBindAheadAndUnbind(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "t", "new-service"))
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "t", "new-service"), "idempotent")
	require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "t", "other"))
	b.publishInTx(t, "t", true, newMsgs(3)...)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = 'new-service'`))

	msgs, err := b.groupSubscriber(t, "new-service", nil).Subscribe(ctx, "t")
	require.NoError(t, err)
	for range 3 {
		receive(t, msgs, 10*time.Second).Ack()
	}

	// Of other's three rows, one is leased by a holder long gone (lease
	// expired) and one is being delivered right now (lease live): the purge
	// takes the first, leaves the second to complete.
	_, err = b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox SET lease_token = gen_random_uuid(),
		leased_until = now() + CASE WHEN id = (SELECT min(id) FROM `+b.Schema+`.outbox WHERE consumer_group = 'other')
		                            THEN -interval '1 minute' ELSE interval '1 minute' END
		 WHERE consumer_group = 'other' AND id < (SELECT max(id) FROM `+b.Schema+`.outbox WHERE consumer_group = 'other')`)
	require.NoError(t, err)
	purged, err := pgoutbox.Unbind(ctx, exec, b.tables, "t", "other", true)
	require.NoError(t, err)
	require.Equal(t, int64(2), purged, "the unleased row and the one whose lease expired")
	b.publishInTx(t, "t", true, newMsg("after"))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = 'other'`), "the delivery under way")

	// A Subscriber binds on every Subscribe: unbound while it runs, the
	// group is bound again by the next subscription of the topic (else the
	// message would go to the default group).
	sub := b.groupSubscriber(t, "new-service", nil)
	first, err := sub.Subscribe(ctx, "t2")
	require.NoError(t, err)
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "t2", "new-service", false)
	require.NoError(t, err)
	subCtx, cancelSub := context.WithCancel(ctx)
	_, err = sub.Subscribe(subCtx, "t2")
	require.NoError(t, err)
	cancelSub()
	rebound := newMsg("rebound")
	b.publishInTx(t, "t2", true, rebound)
	require.Equal(t, rebound.UUID, receive(t, first, 10*time.Second).UUID, "the group got its copy again")

	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "t", "never-bound", true)
	require.ErrorIs(t, err, pgoutbox.ErrNotBound)
	require.Contains(t, err.Error(), `group "never-bound", topic "t"`)
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, "", "x", false)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
	require.ErrorIs(t, pgoutbox.Bind(ctx, exec, b.tables, "t", "bad\x00group"), pgoutbox.ErrInvalidGroup)
}

// A cancel while one group's copy is being delivered deletes the other
// groups' waiting copies and says that not every copy was cancelled: it
// returns false (CancelScheduled), with one copy cancelled and one
// delivering (CancelScheduledCopies), on every claim path.
func TestCancelWhileOneGroupDeliversItsCopySaysSo(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		exec := tx.FromPgxPool(b.Pool)
		for _, g := range []string{"mail", "sms"} {
			require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "reminders", g))
		}
		mail := b.groupSubscriber(t, "mail", func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) })
		subCtx, cancelSub := context.WithCancel(ctx)
		defer cancelSub()
		msgs, err := mail.Subscribe(subCtx, "reminders")
		require.NoError(t, err)

		pub := b.poolPublisher(t)
		for _, key := range []string{"remind-1", "remind-2"} {
			m := newMsg(key)
			pgoutbox.WithDedupKey(m, key)
			require.NoError(t, pub.Publish("reminders", m))
			got := receive(t, msgs, 10*time.Second) // mail's handler runs
			require.Equal(t, m.UUID, got.UUID)

			if key == "remind-1" {
				ok, err := pub.CancelScheduled(ctx, "reminders", key)
				require.NoError(t, err)
				require.False(t, ok, "mail's copy is being delivered")
			} else {
				r, err := pub.CancelScheduledCopies(ctx, "reminders", key)
				require.NoError(t, err)
				require.Equal(t, pgoutbox.CancelResult{Cancelled: 1, Delivering: 1}, r)
			}
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = 'sms' AND dedup_key = $1`, key), "sms's waiting copy cancelled")
			got.Ack()
		}
		pollUntil(t, "mail's copies acked", 10*time.Second, nil, func() bool { return b.outboxRows(t, "reminders") == 0 })

		// Every copy waiting: all cancelled, true.
		m := newMsg("remind-3")
		pgoutbox.WithDedupKey(m, "remind-3")
		pgoutbox.DeliverAfter(m, time.Hour)
		require.NoError(t, pub.Publish("reminders", m))
		r, err := pub.CancelScheduledCopies(ctx, "reminders", "remind-3")
		require.NoError(t, err)
		require.Equal(t, pgoutbox.CancelResult{Cancelled: 2}, r)
	})
}

// A cancel that meets a copy a MoveGroup has locked, in an operator's
// transaction, follows it into its new group once that commits: matched
// on its group, the copy was left there, reported as being delivered
// (nobody delivered it), and delivered later although cancelled. On the
// single table and on a rotating outbox.
func TestCancelFollowsACopyAMoveGroupHadLocked(t *testing.T) {
	t.Parallel()
	for _, rotating := range []bool{false, true} {
		t.Run(map[bool]string{false: "single", true: "rotating"}[rotating], func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			if rotating {
				b = rotatingSetup(t)
			}
			ctx := context.Background()
			exec := tx.FromPgxPool(b.Pool)
			_, err := pgoutbox.BindGroups(ctx, exec, b.tables, "t", []string{"a", "b"})
			require.NoError(t, err)
			pub := b.poolPublisher(t)
			m := newMsg("reminder")
			pgoutbox.DeliverAfter(m, time.Hour)
			pgoutbox.WithDedupKey(m, "k")
			require.NoError(t, pub.Publish("t", m))
			_, err = pgoutbox.Unbind(ctx, exec, b.tables, "t", "b", false)
			require.NoError(t, err)

			op, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = op.Rollback(ctx) })
			moved, err := pgoutbox.MoveGroup(ctx, tx.FromPgxTx(op), b.tables, "t", "b", "c")
			require.NoError(t, err)
			require.EqualValues(t, 1, moved)
			type result struct {
				r   pgoutbox.CancelResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				r, err := pub.CancelScheduledCopies(ctx, "t", "k")
				done <- result{r, err}
			}()
			pollUntil(t, "the cancel waiting for the moved copy", 10*time.Second, nil, func() bool {
				return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
					AND position('DELETE FROM' in query) > 0 AND position($1 in query) > 0`, b.Schema) > 0
			})
			require.NoError(t, op.Commit(ctx))
			r := <-done
			require.NoError(t, r.err)
			require.Equal(t, pgoutbox.CancelResult{Cancelled: 2}, r.r, "a's copy and the moved one")
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE dedup_key = 'k'`), "no copy left to deliver")
		})
	}
}

// Dedup keys are unique per topic and group: every group gets its copy of
// a keyed message, a second publish with the key is skipped for all, and
// CancelScheduled cancels every group's copy. A dead letter says which
// group it failed in.
func TestDedupCancelAndDeadLettersPerGroup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	for _, g := range []string{"a", "b"} {
		require.NoError(t, pgoutbox.Bind(ctx, exec, b.tables, "t", g))
	}
	pub := b.poolPublisher(t)
	timer := newMsg("timer")
	pgoutbox.WithDedupKey(timer, "remind-42")
	pgoutbox.DeliverAfter(timer, time.Hour)
	res, err := pub.PublishWithResult("t", timer)
	require.NoError(t, err)
	require.Empty(t, res.Skipped())
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE dedup_key = 'remind-42'`), "one per group")

	again := newMsg("again")
	pgoutbox.WithDedupKey(again, "remind-42")
	res, err = pub.PublishWithResult("t", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped())

	ok, err := pub.CancelScheduled(ctx, "t", "remind-42")
	require.NoError(t, err)
	require.True(t, ok)
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE dedup_key = 'remind-42'`), "every group's copy")

	// Group a rejects, group b acks: one dead letter, for group a.
	bad := newMsg("bad")
	b.publishInTx(t, "t", true, bad)
	runRouter(t, b.groupSubscriber(t, "a", nil), "t", func(m *message.Message) error { return pgoutbox.Reject(m, "no") })
	evB := newEvents()
	runRouter(t, b.groupSubscriber(t, "b", func(c *pgoutbox.SubscriberConfig) { c.Observer = evB }), "t",
		func(m *message.Message) error { return nil })
	evB.wait(t, pgoutbox.EventAcked, 10*time.Second)
	pollUntil(t, "a dead letter", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq WHERE uuid = $1`, bad.UUID) == 1
	})
	var group string
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT consumer_group FROM `+b.Schema+`.outbox_dlq WHERE uuid = $1`, bad.UUID).Scan(&group))
	require.Equal(t, "a", group)
}

// Rows a subscriber gives back wake the idle subscribers of its own group
// only: the NOTIFY names the group, so another group's idle subscriptions
// of the topic are not sent to claim for nothing (the routing itself is
// tested in internal/notifier).
func TestReleasedRowsWakeOnlyTheirGroup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	listen := listenTo(t, b)
	idle := func(ev *events) func(c *pgoutbox.SubscriberConfig) {
		return func(c *pgoutbox.SubscriberConfig) {
			c.Lease = time.Minute
			c.MinPollInterval, c.MaxPollInterval = 30*time.Second, 30*time.Second
			c.Observer = ev
		}
	}
	holder := b.groupSubscriber(t, "billing", func(c *pgoutbox.SubscriberConfig) { c.DrainTimeout = -1 })
	held, err := holder.Subscribe(ctx, "t")
	require.NoError(t, err)
	shippingEv := newEvents()
	shipping, err := b.groupSubscriber(t, "shipping", idle(shippingEv)).Subscribe(ctx, "t")
	require.NoError(t, err)

	msg := newMsg("x")
	b.publishInTx(t, "t", true, msg)
	require.Equal(t, msg.UUID, receive(t, held, 10*time.Second).UUID) // held, never acked
	got := receive(t, shipping, 10*time.Second)
	require.Equal(t, msg.UUID, got.UUID)
	got.Ack()
	shippingEv.wait(t, pgoutbox.EventAcked, 10*time.Second)
	waitEmptyClaim(t, shippingEv)

	competitorEv := newEvents()
	competitor, err := b.groupSubscriber(t, "billing", idle(competitorEv)).Subscribe(ctx, "t")
	require.NoError(t, err)
	waitEmptyClaim(t, competitorEv)
	countNotifications(t, listen) // the publish's

	require.NoError(t, holder.Close())
	got = receive(t, competitor, 5*time.Second) // far below the 30s poll
	require.Equal(t, msg.UUID, got.UUID)
	got.Ack()

	waitCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := listen.WaitForNotification(waitCtx)
	require.NoError(t, err)
	require.Equal(t, "\x1et\x1ebilling", n.Payload, "the release names its topic and group")
}

// Two handlers of a Router on one Subscriber and topic compete for its
// messages, each getting some, where a user coming from GoChannel expects
// each to get all: the second subscription says so, once, and names what
// gives each handler every message.
func TestTwoSubscriptionsOfATopicOnOneSubscriberSayTheyCompete(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := watermill.NewCaptureLogger()
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables}, logs)
	require.NoError(t, err)
	defer sub.Close()
	compete := func() int {
		n := 0
		for _, l := range logs.Captured()[watermill.InfoLogLevel] {
			if strings.Contains(l.Msg, "compete for its messages") {
				n++
			}
		}
		return n
	}
	_, err = sub.Subscribe(ctx, "a")
	require.NoError(t, err)
	_, err = sub.Subscribe(ctx, "b")
	require.NoError(t, err)
	require.Zero(t, compete(), "one subscription a topic")
	_, err = sub.Subscribe(ctx, "a")
	require.NoError(t, err)
	require.Equal(t, 1, compete())
	for _, l := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.Contains(l.Msg, "compete for its messages") {
			require.Equal(t, "a", l.Fields["topic"])
			require.Contains(t, l.Msg, "a ConsumerGroup of its own")
		}
	}
}
