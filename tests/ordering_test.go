package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// keyedMsgs returns n messages over keys keys: message i has key
// "k<i mod keys>" and metadata seq = its position within its key.
func keyedMsgs(n, keys int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = newMsg(strconv.Itoa(i))
		msgs[i].Metadata.Set("seq", strconv.Itoa(i/keys))
		pgoutbox.WithOrderingKey(msgs[i], "k"+strconv.Itoa(i%keys))
	}
	return msgs
}

// keyLog records, per key, the first successful handling of each message,
// and catches two messages of one key in handlers at once.
type keyLog struct {
	mu        sync.Mutex
	handled   map[string][]int
	done      map[string]bool // uuid -> handled successfully once
	running   map[string]int  // key -> handlers running
	overlaps  int
	inFlight  atomic.Int32
	peak      atomic.Int32
	successes atomic.Int32
}

func newKeyLog() *keyLog {
	return &keyLog{handled: map[string][]int{}, done: map[string]bool{}, running: map[string]int{}}
}

// handler returns a handler that sleeps 0-maxSleep and fails failPct% of
// deliveries.
func (l *keyLog) handler(maxSleep time.Duration, failPct int) message.NoPublishHandlerFunc {
	return func(m *message.Message) error {
		key := m.Metadata.Get(pgoutbox.OrderingKeyMetadataKey)
		l.mu.Lock()
		l.running[key]++
		if l.running[key] > 1 {
			l.overlaps++
		}
		l.mu.Unlock()
		n := l.inFlight.Add(1)
		for p := l.peak.Load(); n > p && !l.peak.CompareAndSwap(p, n); p = l.peak.Load() {
		}
		defer func() {
			l.inFlight.Add(-1)
			l.mu.Lock()
			l.running[key]--
			l.mu.Unlock()
		}()
		if maxSleep > 0 {
			time.Sleep(rand.N(maxSleep + 1))
		}
		if rand.N(100) < failPct {
			return errors.New("injected failure")
		}
		seq, err := strconv.Atoi(m.Metadata.Get("seq"))
		if err != nil {
			return err
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if !l.done[m.UUID] {
			l.done[m.UUID] = true
			l.handled[key] = append(l.handled[key], seq)
			l.successes.Add(1)
		}
		return nil
	}
}

// requireOrder checks that every key's messages were handled in publish
// order, each once, and never two at a time.
func (l *keyLog) requireOrder(t *testing.T, keys, perKey int) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	require.Zero(t, l.overlaps, "two messages of one key were in handlers at once")
	require.Len(t, l.handled, keys)
	want := make([]int, perKey)
	for i := range want {
		want[i] = i
	}
	for key, seqs := range l.handled {
		require.Equal(t, want, seqs, "key %s handled out of publish order", key)
	}
}

// The test: 10,000 messages over 100 keys, 16 in flight, handlers
// that sleep 0-5 ms and fail 5% of deliveries. Every key's messages are
// handled in publish order, one at a time, while different keys run in
// parallel.
func TestOrderingKeysKeepPublishOrderPerKeyInParallel(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		const n, keys = 10_000, 100
		pub := b.poolPublisher(t)
		msgs := keyedMsgs(n, keys)
		for i := 0; i < n; i += 1000 {
			require.NoError(t, pub.Publish("orders", msgs[i:i+1000]...))
		}
		log := newKeyLog()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 16
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 5 * time.Millisecond, MaxAttempts: -1}
		})
		runRouter(t, sub, "orders", log.handler(5*time.Millisecond, 5))
		pollUntil(t, "every message handled", 2*time.Minute, nil, func() bool { return log.successes.Load() == n })
		log.requireOrder(t, keys, n/keys)
		require.Greater(t, log.peak.Load(), int32(4), "different keys ran in parallel")
		pollUntil(t, "the outbox emptied", 10*time.Second, nil, func() bool { return b.outboxRows(t, "orders") == 0 })
	})
}

// Two competing subscribers (each with its own pool, as two processes
// would have) keep each key's order between them: the next message of a
// key is claimable only once the previous one is gone, whoever held it.
func TestOrderingKeysHoldAcrossCompetingSubscribers(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t, pgoutboxtest.Options{MaxConns: 10})
		const n, keys = 2000, 20
		require.NoError(t, b.poolPublisher(t).Publish("orders", keyedMsgs(n, keys)...))
		log := newKeyLog()
		var byWorker [2]atomic.Int32
		for w := range 2 {
			pool, err := pgxpool.New(context.Background(), b.DSN)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			cfg := pgoutbox.SubscriberConfig{
				Tables: b.tables, MaxInFlight: 8, MinPollInterval: 10 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
				RetryPolicy: pgoutbox.ConstantBackoff{Delay: 5 * time.Millisecond, MaxAttempts: -1},
			}
			onPath(t, path, &cfg)
			sub, err := pgoutbox.NewSubscriber(pool, cfg, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			h := log.handler(2*time.Millisecond, 5)
			runRouter(t, sub, "orders", func(m *message.Message) error {
				byWorker[w].Add(1)
				return h(m)
			})
		}
		pollUntil(t, "every message handled", 2*time.Minute, nil, func() bool { return log.successes.Load() == n })
		log.requireOrder(t, keys, n/keys)
		require.Positive(t, byWorker[0].Load(), "both subscribers took part")
		require.Positive(t, byWorker[1].Load(), "both subscribers took part")
	})
}

// A failing head message holds back only its key, through its retries;
// once it is dead-lettered its key moves on. Other keys and unkeyed
// messages never wait for it.
func TestOrderingKeyHeadOfLineFailureBlocksOnlyItsKey(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		for _, parked := range []bool{false, true} {
			t.Run(fmt.Sprintf("parked=%v", parked), func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				if parked {
					b.tables.DeadLetterTable, b.tables.NoDeadLetterTable = "", true
				}
				msg := func(key, name string) *message.Message {
					m := newMsg(name)
					pgoutbox.WithOrderingKey(m, key)
					return m
				}
				require.NoError(t, b.poolPublisher(t).Publish("t",
					msg("a", "a1 poison"), msg("a", "a2"), msg("b", "b1"), newMsg("plain"), msg("b", "b2"), msg("a", "a3")))
				ev := newEvents()
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = 4
					c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 150 * time.Millisecond, MaxAttempts: 4}
					c.Observer = ev
				})
				var mu sync.Mutex
				var order []string
				runRouter(t, sub, "t", func(m *message.Message) error {
					if string(m.Payload) == "a1 poison" {
						return errors.New("poison")
					}
					mu.Lock()
					order = append(order, string(m.Payload))
					mu.Unlock()
					return nil
				})
				dead := ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
				require.Equal(t, 4, dead.Deliveries)
				pollUntil(t, "every other message handled", 10*time.Second, nil, func() bool {
					mu.Lock()
					defer mu.Unlock()
					return len(order) == 5
				})
				mu.Lock()
				defer mu.Unlock()
				pos := map[string]int{}
				for i, p := range order {
					pos[p] = i
				}
				require.Less(t, pos["b1"], pos["b2"])
				require.Less(t, pos["a2"], pos["a3"])
				// b1, b2 and plain ran during a1's 450 ms of retries; a2 only
				// after a1 was dead-lettered (or parked).
				require.Less(t, pos["b2"], pos["a2"], "key b did not wait for key a: %v", order)
				require.Less(t, pos["plain"], pos["a2"], "unkeyed messages did not wait for key a: %v", order)
			})
		}
	})
}

// With MaxInFlight 1 too, a keyed message waiting out a retry delay holds
// back its key only: the other keys and unkeyed messages run meanwhile
// (the delivery guide's order section). Its nack once took the ordered
// subscription's in-process retry, which nothing overtakes: one broken key
// stopped the whole subscription for its delay, forever under
// RetryForever.
func TestOrderedSubscriptionsKeyedRetryHoldsOnlyItsKey(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		require.NoError(t, b.poolPublisher(t).Publish("t",
			keyedMsg("a", "a1 failing"), keyedMsg("a", "a2"), keyedMsg("b", "b1"), newMsg("plain"), keyedMsg("b", "b2")))
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 1
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Hour, MaxAttempts: pgoutbox.RetryForever}
		})
		var mu sync.Mutex
		var order []string
		runRouter(t, sub, "t", func(m *message.Message) error {
			mu.Lock()
			order = append(order, string(m.Payload))
			mu.Unlock()
			if string(m.Payload) == "a1 failing" {
				return errors.New("not yet")
			}
			return nil
		})
		pollUntil(t, "the other key's and the unkeyed messages handled", 15*time.Second, nil, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(order) == 4
		})
		mu.Lock()
		defer mu.Unlock()
		// In the topic's order, a2 left waiting for a1's retry.
		require.Equal(t, []string{"a1 failing", "b1", "plain", "b2"}, order)
	})
}

// delayedHeadMsgs are key a's head "a1 delayed", due after delay, key a's
// next message "a2", and key b's "b1".
func delayedHeadMsgs(delay time.Duration) (first, second, other *message.Message) {
	first = newMsg("a1 delayed")
	pgoutbox.WithOrderingKey(first, "a")
	pgoutbox.DeliverAfter(first, delay)
	second = newMsg("a2")
	pgoutbox.WithOrderingKey(second, "a")
	other = newMsg("b1")
	pgoutbox.WithOrderingKey(other, "b")
	return first, second, other
}

// A delayed message holds back the later messages of its key until it is
// delivered; messages of other keys are not delayed.
func TestOrderingKeyDelayedHeadKeepsOrder(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		first, second, other := delayedHeadMsgs(300 * time.Millisecond)
		start := time.Now() // the delay runs from the publish
		require.NoError(t, b.poolPublisher(t).Publish("t", first, second, other))
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 4
		})
		ch, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		var got []string
		for range 3 {
			m := receive(t, ch, 10*time.Second)
			got = append(got, string(m.Payload))
			if string(m.Payload) == "a1 delayed" {
				require.GreaterOrEqual(t, time.Since(start), 250*time.Millisecond, "the delay applies")
			}
			m.Ack()
		}
		require.Equal(t, []string{"b1", "a1 delayed", "a2"}, got)
	})
}

var errNoAggregateID = errors.New("no aggregate id")

// GenerateOrderingKey keys every message, like Kafka's partition key
// generator; WithOrderingKey wins over it, the key reaches the handler in
// the metadata, and a generator error fails the Publish without writing.
func TestGenerateOrderingKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{
		Tables: b.tables,
		GenerateOrderingKey: func(topic string, m *message.Message) (string, error) {
			if m.Metadata.Get("bad") != "" {
				return "", errNoAggregateID
			}
			return topic + "/" + m.Metadata.Get("aggregate_id"), nil
		},
	}, nil)
	require.NoError(t, err)
	m1 := newMsg("1")
	m1.Metadata.Set("aggregate_id", "42")
	m2 := newMsg("2")
	pgoutbox.WithOrderingKey(m2, "explicit")
	require.NoError(t, pub.Publish("t", m1, m2))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE ordering_key = 't/42'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE ordering_key = 'explicit'`))

	bad := newMsg("bad")
	bad.Metadata.Set("bad", "yes")
	err = pub.Publish("t", newMsg("fine"), bad)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
	require.ErrorIs(t, err, errNoAggregateID, "the generator's own error, for the caller to branch on")
	require.Contains(t, err.Error(), "no aggregate id")
	require.Equal(t, 2, b.outboxRows(t, "t"), "nothing of the failed call was written")

	ch, err := b.subscriber(t, nil).Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "t/42", m.Metadata.Get(pgoutbox.OrderingKeyMetadataKey))
	m.Ack()
}

func keyedMsg(key, payload string) *message.Message {
	m := newMsg(payload)
	pgoutbox.WithOrderingKey(m, key)
	return m
}

// Ids are given at insert, commits come in any order: a message of a key
// committed after a later one of its key was delivered must wait for it,
// not run beside it.
func TestOrderingKeyLateCommitWaitsForTheKeysMessageInFlight(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		t1, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = t1.Rollback(ctx) }()
		p1, err := pgoutbox.NewPublisher(tx.FromPgxTx(t1), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		require.NoError(t, p1.Publish("t", keyedMsg("k", "first id, commits last")))
		require.NoError(t, b.poolPublisher(t).Publish("t", keyedMsg("k", "second id, commits first")))
		ev := newEvents()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 4
			c.Observer = ev
		})
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		m1 := receive(t, ch, 10*time.Second)
		require.Equal(t, "second id, commits first", string(m1.Payload))
		require.NoError(t, t1.Commit(ctx))
		// Claims after the commit see the late row and must leave it.
		before := ev.countKind(pgoutbox.EventClaimed)
		require.NoError(t, b.poolPublisher(t).Publish("t", newMsg("unkeyed"))) // wakes the loop: a claim runs
		require.Equal(t, "unkeyed", string(receive(t, ch, 10*time.Second).Payload))
		// Events reach the observer on a goroutine of their own.
		pollUntil(t, "a claim ran after the commit", 10*time.Second, nil, func() bool { return ev.countKind(pgoutbox.EventClaimed) > before })
		requireNothing(t, ch, 300*time.Millisecond)
		m1.Ack()
		require.Equal(t, "first id, commits last", string(receive(t, ch, 10*time.Second).Payload))
	})
}

// A requeued dead letter of a key whose next message is in flight waits
// for it, then runs before the key's later messages.
func TestOrderingKeyRequeuedDeadLetterWaitsForTheKeysMessageInFlight(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		require.NoError(t, b.poolPublisher(t).Publish("t", keyedMsg("k", "a1"), keyedMsg("k", "a2"), keyedMsg("k", "a3")))
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 4
			c.RetryPolicy = pgoutbox.ConstantBackoff{MaxAttempts: 1}
		})
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, "a1", string(m.Payload))
		m.Nack() // dead-lettered: the key moves on
		m2 := receive(t, ch, 10*time.Second)
		require.Equal(t, "a2", string(m2.Payload))
		n, err := pgoutbox.RequeueDeadLettersMatching(ctx, tx.FromPgxPool(b.Pool), b.tables, pgoutbox.DeadLetterFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		requireNothing(t, ch, 300*time.Millisecond)
		m2.Ack()
		require.Equal(t, "a1", string(receive(t, ch, 10*time.Second).Payload), "the requeued message, at the front of its key")
	})
}

// A head nacked with a delay sorts behind its own backlog once due, and
// other keys keep flowing meanwhile: the windowed pass must still reach it.
func TestOrderingKeyDelayedRetryBehindABacklogIsReached(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, convert_to('k' || g, 'UTF8'), 'k' FROM generate_series(0, 20000) g`)
		require.NoError(t, err)
		_, err = b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, convert_to('hot', 'UTF8'), 'hot' FROM generate_series(1, 3000)`)
		require.NoError(t, err)
		// As autovacuum would: statistics of a backlog of two keys made
		// claims probe the keys through the primary key (seconds a claim,
		// until they ran out of StatementTimeout; see query.olderOfKey).
		_, err = b.Pool.Exec(ctx, `ANALYZE `+b.Schema+`.outbox`)
		require.NoError(t, err)
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 4
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 200 * time.Millisecond, MaxAttempts: -1}
		})
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		// Measured against the flow of key hot, not the clock: k0 must
		// come back before hot's 3,000 messages are all handled (a loaded
		// machine slows both alike).
		nacked, hot := false, 0
		deadline := time.After(2 * time.Minute)
		for hot < 3000 {
			select {
			case m := <-ch:
				switch string(m.Payload) {
				case "k0":
					if !nacked {
						nacked = true
						m.Nack()
						continue
					}
					m.Ack()
					t.Logf("k0 came back after %d of key hot's 3000 messages", hot)
					return
				case "hot":
					hot++
				}
				m.Ack()
			case <-deadline:
				t.Fatalf("k0 (nacked: %v) and %d of key hot's 3000 messages in 2 minutes", nacked, hot)
			}
		}
		t.Fatalf("k0, nacked with a 200 ms delay (nacked: %v), never came back while key hot flowed", nacked)
	})
}

// A subscriber that waits for a key another subscriber holds goes on with
// it as soon as that one lets go of it, also when it lets go by stopping:
// the stopping subscriber acks the key's row during its drain and claims
// nothing after it, and an ack wakes nobody, so the waiting one (whose
// idle polls have grown, every row it saw waiting for the key) would find
// the key free only at its next poll. A's process goes on (another
// subscription on its pool keeps its liveness lock), so no vanished lock
// wakes B either.
func TestOrderingKeyHandedOverWhenItsHolderStops(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		require.NoError(t, b.poolPublisher(t).Publish("hot", keyedMsg("k", "1"), keyedMsg("k", "2"), keyedMsg("k", "3")))
		cfg := func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode, c.MaxInFlight = mode, 1
			c.MinPollInterval, c.MaxPollInterval, c.Lease = 20*time.Millisecond, 30*time.Second, time.Minute
		}
		poolA := b.namedPool(t, "handover-a")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		_, err := b.subscriberOn(t, poolA, cfg).Subscribe(ctx, "other")
		require.NoError(t, err)
		a := b.subscriberOn(t, poolA, cfg)
		outA, err := a.Subscribe(ctx, "hot")
		require.NoError(t, err)
		first := receive(t, outA, 10*time.Second)
		require.Equal(t, "1", string(first.Payload))

		outB, err := b.subscriberOn(t, b.namedPool(t, "handover-b"), cfg).Subscribe(ctx, "hot")
		require.NoError(t, err)
		// B's idle polls grow to seconds: every row it sees waits for k.
		requireNothing(t, outB, 6*time.Second)

		closed := make(chan error, 1)
		go func() { closed <- a.Close() }()
		first.Ack() // during A's drain
		require.NoError(t, <-closed)
		acked := time.Now()
		next := receive(t, outB, 30*time.Second)
		require.Equal(t, "2", string(next.Payload))
		require.Less(t, time.Since(acked), 2*time.Second, "B found the key free only at its next idle poll")
		next.Ack()
	})
}

// A subscription that holds every key of a backlog asks for each key's
// next message as soon as the one before it is acked, not after an idle
// wait: acks that land while a claim runs (a claim over a backlog reads a
// window of rows, all of them behind busy keys) must not leave their keys
// to the poll that claim's empty result schedules. With poll intervals of
// 10 s, 200 messages a key take far less than 4 polls (about 1.5 s; 12 s
// on a machine loaded beyond its cores).
func TestOrderingKeysOfABacklogFollowOneAnotherWithoutWaitingForAPoll(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		const n, keys, poll = 1600, 8, 10 * time.Second
		require.NoError(t, b.poolPublisher(t).Publish("orders", keyedMsgs(n, keys)...))
		log := newKeyLog()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode, c.MaxInFlight = mode, 16
			c.MinPollInterval, c.MaxPollInterval, c.Lease = poll, poll, 3*poll
		})
		started := time.Now()
		runRouter(t, sub, "orders", log.handler(time.Millisecond, 0))
		pollUntil(t, "every message handled", 2*time.Minute, nil, func() bool { return log.successes.Load() == n })
		log.requireOrder(t, keys, n/keys)
		took := time.Since(started)
		t.Logf("%d messages over %d keys in %s", n, keys, took.Round(time.Millisecond))
		require.Less(t, took, 4*poll, "the keys waited for polls")
	})
}

// A keyed subscription holds rows of only as many keys as its handlers
// get through, so another process finds the other keys to run. Here one
// subscriber's only handler is stuck on its first message; before, it had
// leased a row of every key (up to 256) and its competitor ran nothing
// until those leases ended.
func TestAKeyedSubscriptionLeavesTheKeysItCannotRunToItsCompetitors(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		const n, keys = 60, 20
		require.NoError(t, b.poolPublisher(t).Publish("orders", keyedMsgs(n, keys)...))
		stuck := make(chan struct{})
		defer close(stuck)
		first := make(chan struct{}, 1)
		slow := b.subscriberOn(t, b.namedPool(t, "slow"), func(c *pgoutbox.SubscriberConfig) { c.ClaimMode, c.MaxInFlight = mode, 1 })
		runRouter(t, slow, "orders", func(m *message.Message) error {
			select {
			case first <- struct{}{}:
			default:
			}
			select {
			case <-stuck:
			case <-m.Context().Done():
			}
			return errors.New("released at the end of the test")
		})
		<-first

		log := newKeyLog()
		other := b.subscriberOn(t, b.namedPool(t, "other"), func(c *pgoutbox.SubscriberConfig) { c.ClaimMode, c.MaxInFlight = mode, 4 })
		runRouter(t, other, "orders", log.handler(time.Millisecond, 0))
		// The stuck key's messages wait; so may those of the one key the
		// slow subscriber holds ready behind it. Every other key runs.
		want := n - 2*n/keys
		pollUntil(t, fmt.Sprintf("the competitor ran the %d messages of the keys the stuck subscriber cannot", want), 20*time.Second, nil,
			func() bool { return int(log.successes.Load()) >= want })
	})
}

// A subscription's first claims read no window (no keyed row seen yet),
// and on a backlog of a few keys such a claim walks every row of it,
// each held back by its key, looking for rows to fill its limit. Deep
// enough, it runs out of StatementTimeout, and the same claim failed
// again, for good: the subscription took nothing. A claim that failed
// slowly now makes the next ones read windows, on every claim mode.
func TestAKeyedBacklogDeeperThanAClaimCanWalkIsTaken(t *testing.T) {
	t.Parallel()
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
			SELECT 't', gen_random_uuid()::text, '\x00', 'k' || (g % 3) FROM generate_series(1, 60000) g`)
		require.NoError(t, err)
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.ClaimMode = mode
			c.MaxInFlight = 16
			// The claim through 60,000 rows takes about a second here;
			// a window of them a few milliseconds.
			c.StatementTimeout = 150 * time.Millisecond
		})
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		for i := range 30 {
			select {
			case m := <-ch:
				m.Ack()
			case <-time.After(30 * time.Second):
				t.Fatalf("%d messages of the keyed backlog taken in 30 s, 30 expected", i)
			}
		}
	})
}

// A keyed message nacked with a short delay, in a backlog of its key,
// comes back after about its delay. The claim after its nack asked for the
// key's next row, found the retry not yet due, and nothing asked again:
// its new due time put it behind the backlog, reached only at the end of a
// pass through it, its key waiting all along (6,000 rows of 3 keys, every
// 20th of a key failing once with a 100 ms delay: retries back after up to
// 2.5 s, the backlog not drained in 90 s).
func TestAKeyedRetryInABacklogComesBackAfterItsDelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const keys, perKey = 3, 1500
	_, err := b.Pool.Exec(context.Background(), `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, ordering_key)
		SELECT 't', gen_random_uuid()::text, convert_to(g::text, 'UTF8'), 'k' || (g % 3) FROM generate_series(0, 4499) g`)
	require.NoError(t, err)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 8
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 100 * time.Millisecond, MaxAttempts: -1}
		c.MinPollInterval, c.MaxPollInterval = 0, 0 // the defaults: the tests' shorter polls hid it
	})
	var mu sync.Mutex
	failedAt := map[string]time.Time{}
	back := make(chan time.Duration, keys*perKey/20)
	runRouter(t, sub, "t", func(m *message.Message) error {
		i, err := strconv.Atoi(string(m.Payload))
		if err != nil || (i/keys)%20 != 10 { // every 20th message of each key fails once
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if at, ok := failedAt[m.UUID]; ok {
			back <- time.Since(at)
			return nil
		}
		failedAt[m.UUID] = time.Now()
		return errors.New("transient")
	})
	var worst time.Duration
	for n := range cap(back) {
		select {
		case d := <-back:
			worst = max(worst, d)
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d retries came back, then none for 30 s (the slowest so far after %s)", n, cap(back), worst)
		}
	}
	t.Logf("slowest retry: %s", worst)
	// The delay is 100 ms; a second or more meant the retry waited for a
	// pass through the backlog.
	require.Less(t, worst, time.Second, "the slowest retry came back %s after its nack", worst)
}
