package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// Unit tests of the owner's state transitions, the prefetch sizing and the
// claim cursor: the owner's methods are driven directly, with the results
// the claim goroutine and the completer would send, and nothing touches a
// database (the pool never connects). tests/ covers the same behaviour
// end to end on a real PostgreSQL.

type testBundle struct {
	sub    *subscription
	events *eventLog
}

type eventLog struct {
	mu     sync.Mutex
	kinds  []EventKind
	phases []string // of the EventLeaseLost events
}

func (e *eventLog) Observe(ev Event) {
	e.mu.Lock()
	e.kinds = append(e.kinds, ev.Kind)
	if ev.Kind == EventLeaseLost {
		e.phases = append(e.phases, ev.Phase)
	}
	e.mu.Unlock()
}

func (e *eventLog) count(k EventKind) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, got := range e.kinds {
		if got == k {
			n++
		}
	}
	return n
}

func setup(t *testing.T, mod func(*SubscriberConfig)) *testBundle {
	t.Helper()
	// A pool that is never used: pgxpool connects lazily.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?sslmode=disable")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	events := &eventLog{}
	cfg := SubscriberConfig{Lease: 10 * time.Second, Observer: ObserverFunc(events.Observe)}
	if mod != nil {
		mod(&cfg)
	}
	s, err := NewSubscriber(pool, cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { s.obs.close(time.Minute) })
	// A notifier that never connects: liveness unknown, no wake-ups.
	n := notifier.Acquire(pool, s.logger)
	t.Cleanup(n.Release)
	return &testBundle{sub: newSubscription(s, context.Background(), "t", n.Listen(s.q.Names.Channel, "t", ""), serverClock{}), events: events}
}

// eventCount counts the events of a kind reported so far: it lets the
// Subscriber's event goroutine deliver everything first (closing it).
func (b *testBundle) eventCount(k EventKind) int {
	b.sub.s.obs.close(time.Minute)
	return b.events.count(k)
}

// claimed feeds the owner a claim result of rows with the given ids.
func (b *testBundle) claimed(t *testing.T, ids ...int64) []*delivery {
	t.Helper()
	req := b.sub.claims.scan.request(len(ids), b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	var rows []*delivery
	for _, id := range ids {
		rows = append(rows, &delivery{claimedRow: claimedRow{id: id, token: req.token, deliveries: 1, uuid: "u", payload: []byte("p"), metaRaw: []byte(`{}`), availableAt: time.Unix(id, 0)}})
	}
	b.sub.onClaimed(claimResult{req: req, rows: rows, last: scanEnd{id: pgtype.Int8{Int64: ids[len(ids)-1], Valid: true}}})
	return rows
}

// handOut hands the next message out, as if the Router took it.
func (b *testBundle) handOut(t *testing.T) *delivery {
	t.Helper()
	d, ch := b.sub.nextMessage(time.Now())
	require.NotNil(t, ch, "a message may go out")
	b.sub.handedOut(d)
	return d
}

// written reports every op of the pending job written, as the completer
// would.
func (b *testBundle) written(lost ...*delivery) {
	job := b.sub.writes.pending
	b.sub.writes.pending = writeJob{}
	r := writeResult{job: job, done: written{}, sent: time.Now(), abandoned: map[*delivery]error{}}
	isLost := func(d *delivery) bool {
		for _, l := range lost {
			if l == d {
				return true
			}
		}
		return false
	}
	mark := func(d *delivery) {
		if !isLost(d) {
			r.done[writtenKey{d.id, d.token.Bytes}] = true
		}
	}
	for _, d := range job.acks {
		mark(d)
	}
	for _, op := range job.returns {
		mark(op.d)
	}
	for _, op := range job.holds {
		mark(op.d)
	}
	for _, op := range job.dead {
		mark(op.d)
	}
	b.sub.writes.inWrite = true
	b.sub.onWritten(r)
}

func TestOwnerHandsOutInQueueOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2 })
	b.claimed(t, 1, 2, 3, 4, 5)
	b.sub.dispatch(time.Now())
	require.Equal(t, 5, b.sub.hand.handed, "the whole window is queued for the two slots")
	for id := range int64(5) {
		it := <-b.sub.outlet.slots.queue
		require.Equal(t, id+1, it.d.id, "in queue order")
		require.Equal(t, it.d.seq, it.seq)
	}

	ordered := setup(t, nil)
	ordered.claimed(t, 1, 2)
	require.Equal(t, int64(1), ordered.handOut(t).id)
	_, ch := ordered.sub.nextMessage(time.Now())
	require.Nil(t, ch, "MaxInFlight 1: the second waits for the first's verdict")
	require.Equal(t, int64(2), ordered.sub.hand.ready.id, "prepared meanwhile")
}

func TestOwnerAckIsWrittenThenFinished(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	b.claimed(t, 1)
	d := b.handOut(t)
	msg := d.msg
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg, ack: true}, false)
	require.Equal(t, writing, d.state)
	require.Equal(t, []*delivery{d}, b.sub.writes.pending.acks)
	require.ErrorIs(t, msg.Context().Err(), context.Canceled, "Ack ends the message's context")
	b.written()
	require.Equal(t, finished, d.state)
	require.Empty(t, b.sub.hand.rows)
	require.Equal(t, 1, b.eventCount(EventAcked))
	require.Nil(t, d.payload, "a finished row keeps no bytes: its claim's slab may outlive it")
	require.Nil(t, d.metaRaw)

	// A second answer to the same message changes nothing.
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg, ack: true}, false)
	require.Empty(t, b.sub.writes.pending.acks)
}

func TestOwnerReportsLostLeaseOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	b.claimed(t, 1)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
	b.written(d) // the token no longer matched
	require.Equal(t, finished, d.state)
	require.Equal(t, 1, b.eventCount(EventLeaseLost))
	require.Zero(t, b.eventCount(EventAcked))
}

func TestOwnerOrderedNackIsRetriedBeforeTheBuffer(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) {
		c.RetryPolicy = ConstantBackoff{Delay: 0, MaxAttempts: -1}
	})
	b.claimed(t, 1, 2, 3)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	require.Equal(t, retrying, d.state)
	require.Len(t, b.sub.writes.pending.holds, 1, "the nack is written as a hold: the row stays ours")
	_, ch := b.sub.nextMessage(time.Now())
	require.Nil(t, ch, "nothing goes out before the hold is written")
	b.written()
	again := b.handOut(t)
	require.Same(t, d, again, "the nacked message goes out again first")
	require.Equal(t, 2, again.deliveries)
	b.sub.onVerdict(verdict{d: again, seq: again.seq, msg: again.msg, ack: true}, false)
	require.Equal(t, int64(2), b.handOut(t).id)
}

// A retry that waits out a delay is counted when it goes out, by a hold of
// its own: counted at the nack, a process killed during the wait had a
// delivery counted that never ran. A give-back during the wait takes
// nothing back: the delivery counted last is the one that failed.
func TestOwnerOrderedRetryAfterADelayIsCountedWhenItGoesOut(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) {
		c.RetryPolicy = ConstantBackoff{Delay: time.Millisecond, MaxAttempts: -1}
	})
	b.claimed(t, 1, 2)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	holds := b.sub.writes.pending.holds
	require.Len(t, holds, 1)
	require.False(t, holds[0].counts, "the nack's hold counts nothing")
	b.written()
	require.Equal(t, 1, b.eventCount(EventRetried))
	_, ch := b.sub.nextMessage(time.Now().Add(time.Second))
	require.Nil(t, ch, "nothing goes out before the retry's count is written")
	holds = b.sub.writes.pending.holds
	require.Len(t, holds, 1)
	require.True(t, holds[0].counts && holds[0].countOnly, "the retry's count, at its hand-out")
	b.written()
	again, ch := b.sub.nextMessage(time.Now().Add(time.Second)) // past its delay
	require.NotNil(t, ch, "the retry goes out once its count is written")
	b.sub.handedOut(again)
	require.Same(t, d, again)
	require.Equal(t, 2, again.deliveries)
}

func TestOwnerOrderedRetryGivenBackDuringItsDelayKeepsItsCount(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) {
		c.RetryPolicy = ConstantBackoff{Delay: time.Hour, MaxAttempts: -1}
	})
	b.claimed(t, 1)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	b.written()
	b.sub.beginStop()
	require.Len(t, b.sub.writes.pending.returns, 1)
	require.Zero(t, b.sub.writes.pending.returns[0].undo, "the delivery counted last ran")
}

func TestOwnerOrderedNackWithDelayGivesTheBufferBack(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) {
		c.RetryPolicy = ConstantBackoff{Delay: time.Hour, MaxAttempts: -1}
	})
	b.claimed(t, 1, 2, 3)
	d := b.handOut(t)
	gen := b.sub.claims.gen
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	require.Empty(t, b.sub.hand.buffer)
	require.Greater(t, b.sub.claims.gen, gen, "a claim under way gives its rows back too")
	require.Len(t, b.sub.writes.pending.returns, 2)
	for _, op := range b.sub.writes.pending.returns {
		require.Equal(t, int32(1), op.undo, "never handed out: the delivery is taken back")
		require.False(t, op.delay.Valid, "released rows keep their place")
	}
	require.Equal(t, 2, b.sub.claims.givingBack)
	b.written()
	require.Zero(t, b.sub.claims.givingBack)
	_, ch := b.sub.nextMessage(time.Now())
	require.Nil(t, ch, "the retry waits an hour, and nothing overtakes it")
}

func TestOwnerUnorderedNackReturnsTheRowWithItsDelay(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) {
		c.MaxInFlight = 4
		c.RetryPolicy = ConstantBackoff{Delay: time.Second, MaxAttempts: -1}
	})
	b.claimed(t, 1)
	d := b.handOut(t)
	d.outcome.setErr(errors.New("boom"))
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg}, false)
	require.Len(t, b.sub.writes.pending.returns, 1)
	op := b.sub.writes.pending.returns[0]
	require.Equal(t, time.Second.Microseconds(), op.delay.Int64)
	require.Equal(t, "boom", op.err.String)
	b.written()
	require.Equal(t, 1, b.eventCount(EventRetried))
}

func TestOwnerAckDeadlineNacksWithARecordedError(t *testing.T) {
	t.Parallel()
	// MaxInFlight 1: the owner waits for the verdict and keeps the
	// deadline (with more, each slot does: tests/engine_test.go).
	b := setup(t, func(c *SubscriberConfig) {
		c.AckDeadline = time.Millisecond
		c.RetryPolicy = ConstantBackoff{Delay: 0, MaxAttempts: -1}
	})
	b.claimed(t, 1)
	d := b.handOut(t)
	msg := d.msg
	b.sub.housekeeping(time.Now().Add(time.Second))
	require.ErrorIs(t, msg.Context().Err(), context.Canceled, "the handler is told to stop")
	require.Len(t, b.sub.writes.pending.holds, 1, "ordered: the row is held for its retry")
	require.Contains(t, b.sub.writes.pending.holds[0].err.String, "ack deadline exceeded")
	require.Zero(t, b.sub.hand.handed)
	// A late Ack is ignored.
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg, ack: true}, false)
	require.Empty(t, b.sub.writes.pending.acks)
}

func TestOwnerBackpressureStopsHandingOutAndClaiming(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	b.claimed(t, 1, 2)
	b.sub.claims.claiming = false
	for range maxPendingCompletions {
		b.sub.writes.pending.acks = append(b.sub.writes.pending.acks, &delivery{})
	}
	require.True(t, b.sub.backpressured())
	_, ch := b.sub.nextMessage(time.Now())
	require.Nil(t, ch)
	b.sub.startClaim(time.Now()) // would need the notifier if it claimed
	require.False(t, b.sub.claims.claiming)
}

func TestOwnerClaimStartedBeforeAGiveBackGivesItsRowsBack(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.claimed(t, 1)
	b.sub.giveBack(b.sub.hand.takeBuffer()) // meanwhile: the buffer went back
	rows := []*delivery{{claimedRow: claimedRow{id: 5, token: req.token, metaRaw: []byte(`{}`)}}, {claimedRow: claimedRow{id: 6, token: req.token, metaRaw: []byte(`{}`)}}}
	b.sub.onClaimed(claimResult{req: req, rows: rows})
	require.Empty(t, b.sub.hand.buffer, "rows newer than those given back must not overtake them")
	require.Equal(t, 3, b.sub.claims.givingBack)
}

func TestOwnerLostClaimIsReleasedBeforeClaimingOn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req, err: errors.New("reply lost")})
	require.Len(t, b.sub.claims.lost.list, 1)
	require.Equal(t, 1, b.sub.claims.givingBack, "claims wait for the release")
	b.sub.startWrite(time.Now().Add(time.Hour)) // past the backoff
	require.Equal(t, []pgtype.UUID{req.token}, drainJob(b))
	b.sub.onReleasedClaims([]pgtype.UUID{req.token}, nil, time.Now().Add(time.Hour))
	require.Empty(t, b.sub.claims.lost.list)
	require.Zero(t, b.sub.claims.givingBack)
	require.Equal(t, scanFromStart, b.sub.claims.scan.from.at, "the released rows lie behind any cursor")
}

// A lost claim released while it might still run on the server (the
// network may hold it back past its release) lets claims go on, and is
// released once more after its deadline passed, whatever the first
// release found.
func TestOwnerLostClaimIsReleasedAgainOnceItCanNoLongerRun(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	sent := time.Now()
	req := b.sub.claims.scan.request(2, b.sub.claims.gen, sent)
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req, err: errors.New("reply lost"), started: sent})
	b.sub.startWrite(sent.Add(time.Hour)) // past the backoff
	require.Equal(t, []pgtype.UUID{req.token}, drainJob(b))
	b.sub.onReleasedClaims([]pgtype.UUID{req.token}, nil, sent.Add(b.sub.cfg.StatementTimeout))
	require.Zero(t, b.sub.claims.givingBack, "claims go on")
	require.Len(t, b.sub.claims.lost.list, 1, "the claim may still run until its deadline")
	again := sent.Add(b.sub.cfg.StatementTimeout + lostClaimMargin)
	require.Equal(t, again, b.sub.claims.lost.recheckAt())
	require.Empty(t, b.sub.claims.lost.releasable(again.Add(-time.Millisecond)))

	b.sub.startWrite(again)
	require.Equal(t, []pgtype.UUID{req.token}, drainJob(b), "released again")
	b.sub.onReleasedClaims([]pgtype.UUID{req.token}, errors.New("connection refused"), again)
	require.Len(t, b.sub.claims.lost.list, 1, "a failed release is tried again")
	require.Zero(t, b.sub.claims.givingBack)
	b.sub.claims.scan.from.at = pgtype.Timestamptz{Time: again, Valid: true} // claims went on
	b.sub.onReleasedClaims([]pgtype.UUID{req.token}, nil, again)
	require.Empty(t, b.sub.claims.lost.list)
	require.Zero(t, b.sub.claims.givingBack)
	require.True(t, b.sub.claims.lost.recheckAt().IsZero())
	require.Equal(t, scanFromStart, b.sub.claims.scan.from.at, "what the second release gave back lies behind any cursor")
}

// drainJob takes the job startWrite submitted and returns its release
// tokens.
func drainJob(b *testBundle) []pgtype.UUID {
	j := <-b.sub.runners.completer.jobs
	b.sub.writes.inWrite = false
	return j.releaseTokens
}

// The handler still running when the drain ends is logged, once, at WARN
// (an operator saw nothing of a deploy's Close that sent messages back).
func TestOwnerStopGivesBackTheBufferAndReleasesAfterTheDrain(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2 })
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	b.claimed(t, 1, 2, 3)
	d := b.handOut(t)
	<-b.sub.outlet.slots.queue // a slot took it to the Router
	b.sub.claims.claiming = false
	b.sub.beginStop()
	require.Len(t, b.sub.writes.pending.returns, 2, "the buffer goes back at once")
	require.False(t, b.sub.finishedStopping(time.Now()), "a handler is still running")
	b.sub.endDrain(true)
	warned := logs.Captured()[watermill.InfoLogLevel] // Watermill's level for a warning (logWarn)
	require.Len(t, warned, 1)
	require.Equal(t, "drain_timeout", warned[0].Fields["event"])
	require.Equal(t, 1, warned[0].Fields["running"])
	require.Len(t, b.sub.writes.pending.returns, 3)
	last := b.sub.writes.pending.returns[2]
	require.Same(t, d, last.d)
	require.Equal(t, int32(0), last.undo, "it was delivered: the count stays")
	b.written()
	require.True(t, b.sub.finishedStopping(time.Now()))
	require.Equal(t, 3, b.eventCount(EventReleased))
}

// NoDrain is chosen: a stop that gives back the messages in flight at
// once is not warned of on every deploy.
func TestOwnerStopWithNoDrainIsNoWarning(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2; c.DrainTimeout = NoDrain })
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	b.claimed(t, 1, 2)
	b.handOut(t)
	<-b.sub.outlet.slots.queue
	b.sub.claims.claiming = false
	b.sub.beginStop()
	require.Empty(t, logs.Captured()[watermill.InfoLogLevel])
	require.NotEmpty(t, logs.Captured()[watermill.DebugLogLevel])
}

func TestOwnerStalledBufferGoesBackWhole(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.sub.claims.pf.disabled = true // the half-a-lease rule, not the rate's (MaxDeliveries)
	b.claimed(t, 1, 2, 3)
	d := b.handOut(t) // MaxInFlight 1: 2 and 3 wait
	b.sub.housekeeping(time.Now().Add(b.sub.cfg.Lease))
	require.Empty(t, b.sub.hand.buffer)
	require.Len(t, b.sub.writes.pending.returns, 2)
	require.Equal(t, handedOut, d.state, "the message in flight stays")
}

// Handlers that turn slow leave a buffer sized to their former rate: it
// goes back once the rate they answer at would not get through it within
// a second and a row has waited that long, not after half a lease, so a
// competitor takes the rows. A buffer the handlers get through stays.
func TestOwnerBufferGoesBackWhenHandlersTurnSlow(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	require.Equal(t, time.Second, bufferPatience(b.sub.cfg), "a lease of more than two seconds: a second")
	b.claimed(t, 1, 2, 3)
	b.handOut(t)
	claimed := processStart.Add(time.Duration(b.sub.hand.buffer[0].claimedAt))
	b.sub.housekeeping(claimed.Add(900 * time.Millisecond))
	require.Len(t, b.sub.hand.buffer, 2, "nothing answered, but nothing waited a second yet")
	b.sub.claims.pf.verdicts(5000)
	b.sub.housekeeping(claimed.Add(1100 * time.Millisecond))
	require.Len(t, b.sub.hand.buffer, 2, "the handlers answer fast: the buffer stays")
	b.sub.housekeeping(claimed.Add(2200 * time.Millisecond))
	require.Empty(t, b.sub.hand.buffer, "nothing answered for a second")
	require.Len(t, b.sub.writes.pending.returns, 2)

	// The owner holding rows back is not a slow handler: acks waiting to
	// be written in such numbers (backpressure), say during an outage.
	behind := setup(t, nil)
	behind.claimed(t, 1, 2, 3)
	behind.handOut(t)
	behind.sub.writes.pending.acks = make([]*delivery, maxPendingCompletions)
	at := processStart.Add(time.Duration(behind.sub.hand.buffer[0].claimedAt)).Add(2 * time.Second)
	require.False(t, behind.sub.prefetchStalled(at), "backpressured: the buffer stays")
	behind.sub.writes.pending.acks = nil
	require.True(t, behind.sub.prefetchStalled(at.Add(time.Second)))

	short := setup(t, func(c *SubscriberConfig) { c.Lease = time.Second; c.StatementTimeout = 400 * time.Millisecond })
	require.Equal(t, 500*time.Millisecond, bufferPatience(short.sub.cfg), "half a short lease")
}

// The same for the slots' queue, where a subscription with MaxInFlight >
// 1 keeps what its handlers take next.
func TestOwnerSlotsQueueGoesBackWhenHandlersTurnSlow(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2 })
	b.claimed(t, 1, 2, 3, 4, 5)
	start := time.Now()
	b.sub.dispatch(start)
	require.Equal(t, 5, b.sub.outlet.slots.queued(), "no slot runs here: all wait in the queue")
	b.sub.housekeeping(start.Add(900 * time.Millisecond))
	require.Equal(t, 5, b.sub.outlet.slots.queued(), "nothing waited a second yet")
	b.sub.housekeeping(start.Add(1100 * time.Millisecond))
	require.Zero(t, b.sub.outlet.slots.queued())
	require.Len(t, b.sub.writes.pending.returns, 5)
}

func TestOwnerRenewalSkipsRowsWithAPendingWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2 })
	b.sub.claims.pf.disabled = true // rows wait beside no answer for half a lease: kept here, renewed
	b.claimed(t, 1, 2, 3)
	acked := b.handOut(t)
	b.sub.onVerdict(verdict{d: acked, seq: acked.seq, msg: acked.msg, ack: true}, false)
	b.sub.housekeeping(b.sub.house.nextRenew)
	require.Len(t, b.sub.writes.pending.renew, 2, "the acked row's lease ends with its write")
	for _, d := range b.sub.writes.pending.renew {
		require.NotSame(t, acked, d)
	}
}

func TestPrefetchFollowsTheConsumptionRate(t *testing.T) {
	t.Parallel()
	now := time.Now()
	p := newPrefetch(4, true, now)
	require.Equal(t, 4, p.claimSize(0, now, false), "idle: free slots only")
	require.Zero(t, p.claimSize(4, now, false), "no free slot: no claim")

	p.verdicts(1000) // 1000 verdicts in 10ms: 100k/s
	now = now.Add(10 * time.Millisecond)
	require.Equal(t, maxClaim, p.claimSize(0, now, false), "a claim is capped")
	require.Equal(t, 4000, p.allowance, "40ms (prefetchHorizon) worth of consumption")

	p.verdicts(1e6)
	now = now.Add(10 * time.Millisecond)
	p.sample(now)
	require.Equal(t, maxPrefetch, p.allowance, "capped")

	now = now.Add(time.Second) // a long quiet interval
	p.sample(now)
	require.Zero(t, p.allowance, "an idle subscription stops prefetching")

	off := newPrefetch(4, false, now)
	off.verdicts(1000)
	require.Equal(t, 4, off.claimSize(0, now.Add(10*time.Millisecond), false), "MaxDeliveries set: no prefetch")
}

// A keyed subscription holds rows of more keys than its handlers run, as
// many as they get through while a key's next row comes (its ack, the
// claim that asks for it): a slow one holds about its MaxInFlight, so
// competing subscribers find keys to run; a fast one holds many.
func TestKeyedPrefetchFollowsTheConsumptionRate(t *testing.T) {
	t.Parallel()
	now := time.Now()
	slow := newPrefetch(1, true, now)
	require.Equal(t, 2, slow.claimSize(0, now, true), "idle: a row per handler, and one ready behind it")
	slow.verdicts(1) // 200ms handlers: 5/s
	now = now.Add(200 * time.Millisecond)
	require.Zero(t, slow.claimSize(2, now, true), "no more than that while slow")

	fast := newPrefetch(16, true, now)
	require.Equal(t, 32, fast.claimSize(0, now, true))
	for range 10 { // 1ms handlers: 16,000/s
		fast.verdicts(16 * 5)
		now = now.Add(5 * time.Millisecond)
		fast.sample(now)
	}
	require.Equal(t, 400, fast.keyedAllowance(), "16,000/s over 25ms")
	require.Equal(t, maxKeyedClaim, fast.claimSize(0, now, true), "a keyed claim is capped")
	require.Equal(t, 16+400-maxKeyedClaim, fast.claimSize(maxKeyedClaim, now, true), "the handlers' rows and the allowance")
	require.Zero(t, fast.claimSize(16+400, now, true), "in flight and the allowance held: no claim")
	for range 10 { // 16,000 every millisecond: more than any buffer of keys may hold
		fast.verdicts(16 * 5 * 1000)
		now = now.Add(5 * time.Millisecond)
		fast.sample(now)
	}
	require.Equal(t, maxKeyedAllowance, fast.keyedAllowance(), "capped")
	require.Equal(t, maxKeyedClaim, fast.claimSize(0, now, true), "a keyed claim is capped")
	require.Less(t, maxKeyedAllowance, fast.allowance, "an unkeyed subscription at this rate would hold more")
	require.Zero(t, fast.claimSize(16+maxKeyedAllowance, now, true), "a keyed one holds no more than its cap")
	require.Positive(t, fast.claimSize(16+maxKeyedAllowance, now, false), "where an unkeyed one claims more")

	half := newPrefetch(4, true, now)
	half.verdicts(20) // 2,000/s
	now = now.Add(10 * time.Millisecond)
	half.sample(now)
	require.Equal(t, 50, half.keyedAllowance(), "2,000/s over 25ms")

	off := newPrefetch(1, false, now)
	require.Equal(t, 1, off.claimSize(0, now, true), "MaxDeliveries set: no prefetch, keyed or not")
}

func TestClaimScanCursor(t *testing.T) {
	t.Parallel()
	start := time.Now()
	c := newClaimScan()
	req := c.request(10, 0, start)
	require.Equal(t, scanFromStart, req.from.at)
	require.True(t, req.withExpired(), "the first claim looks for expired leases")
	rows := []*delivery{{claimedRow: claimedRow{id: 7, availableAt: start}}, {claimedRow: claimedRow{id: 9, availableAt: start}}}
	c.claimed(claimResult{req: req, rows: rows, last: scanEnd{id: pgtype.Int8{Int64: 9, Valid: true}}})
	require.Equal(t, int64(9), c.from.id, "the next claim starts after the last ready row")

	req = c.request(10, 0, start.Add(time.Millisecond))
	require.Equal(t, int64(9), req.from.id)
	require.False(t, req.withExpired(), "expired leases: once a second")

	c.claimed(claimResult{req: req})
	req = c.request(10, 0, start.Add(rescanEvery))
	require.True(t, req.withExpired())
	c.claimed(claimResult{req: req})
	require.Equal(t, scanFromStart, c.from.at, "every second the scan starts over")

	c.restart(true)
	require.True(t, c.request(1, 0, start.Add(rescanEvery)).withExpired())
}

// The message a delivery decodes into leaves Watermill's delay keys out,
// but hands DelayOnError its last delay back.
func TestDeliveryMessageDropsDelayKeys(t *testing.T) {
	t.Parallel()
	d := &delivery{claimedRow: claimedRow{uuid: "u", metaRaw: []byte(`{"_watermill_delayed_for": "1s", "_watermill_delayed_until": "x", "k": "v"}`)}}
	msg, err := decodeMessage(d.uuid, d.payload, d.metaRaw)
	require.NoError(t, err)
	require.Equal(t, message.Metadata{"k": "v"}, msg.Metadata)

	d.metaRaw = []byte(`{"_pgoutbox_retry_delayed_for": "2s"}`)
	msg, err = decodeMessage(d.uuid, d.payload, d.metaRaw)
	require.NoError(t, err)
	require.Equal(t, message.Metadata{"_watermill_delayed_for": "2s"}, msg.Metadata)
}

// A wake-up that arrives while a claim runs may announce a row the claim's
// snapshot missed: an empty claim then claims again instead of sleeping.
func TestOwnerWakeDuringAnEmptyClaimIsNotLost(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	req := b.sub.claims.scan.request(1, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.sub.claims.wake(false) // a NOTIFY while the claim runs
	b.sub.onClaimed(claimResult{req: req})
	require.True(t, b.sub.claims.want, "claim again")
	require.True(t, b.sub.claims.idleUntil.IsZero(), "no sleep")

	req = b.sub.claims.scan.request(1, b.sub.claims.gen, time.Now())
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req})
	require.False(t, b.sub.claims.want, "nothing woke it: an empty claim goes idle")
	require.False(t, b.sub.claims.idleUntil.IsZero())
}

// A lease claim that left arrivals to open held batches and found nothing
// else does not put the subscription to sleep, nor make it idle for
// ClaimAuto: it claims again at once, once.
func TestOwnerClaimThatLeftArrivalsToHeldBatchesClaimsAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.sub.held.busy = true
	withheld := func() {
		req := b.sub.claims.scan.request(1, b.sub.claims.gen, time.Now())
		req.arrivals.after = noArrivals
		b.sub.claims.claiming = true
		b.sub.onClaimed(claimResult{req: req})
	}
	withheld()
	require.True(t, b.sub.claims.want, "claim again")
	require.True(t, b.sub.claims.idleUntil.IsZero(), "no sleep")
	require.True(t, b.sub.held.busy, "still busy")

	withheld() // the batches were still open: sleep as usual
	require.False(t, b.sub.claims.want)
	require.False(t, b.sub.claims.idleUntil.IsZero())
}

// Ordered: a handed-out row found lost (a renewal that did not match) has
// its context cancelled, and nothing else is handed out until its handler
// returns, so two messages never run at once.
func TestOwnerOrderedLostRowHoldsTheNextUntilItsHandlerReturns(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.claimed(t, 1, 2)
	d := b.handOut(t)
	msg := d.msg
	b.sub.dropLost(d, "renew")
	require.Error(t, msg.Context().Err(), "its handler is told to stop")
	_, ch := b.sub.nextMessage(time.Now())
	require.Nil(t, ch, "the next waits for the lost row's handler")
	msg.Ack()
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg, ack: true}, false)
	next, ch := b.sub.nextMessage(time.Now())
	require.NotNil(t, ch)
	require.Equal(t, int64(2), next.id)
}

// Rows claimed again while an earlier delivery of theirs was ours wait
// for it; when those end in one turn (a failed held batch's rows, in any
// order), the rows go out in queue order, not in the order they were let
// go (each went in front of the one before: 5 4 3 2).
func TestOwnerRowsLetGoInOneTurnGoOutInQueueOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	earlier := b.claimed(t, 2, 3, 4, 5)
	b.claimed(t, 2, 3, 4, 5)
	require.Len(t, b.sub.hand.guard.parked, 4, "claimed again while ours: parked")
	for _, i := range []int{3, 1, 0, 2} {
		b.sub.endRow(earlier[i])
	}
	require.Empty(t, b.sub.hand.guard.parked)
	for _, id := range []int64{2, 3, 4, 5} {
		d := b.handOut(t)
		require.Equal(t, id, d.id, "in queue order")
		require.NotSame(t, earlier[id-2], d, "the delivery claimed again")
		b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
		b.written()
	}
	_, ch := b.sub.nextMessage(time.Now())
	require.Nil(t, ch, "nothing else goes out")
}

// With MaxDeliveries, a redelivered row runs alone: it is kept only with
// nothing ahead of it (nothing out, buffered or before it in its claim),
// and nothing of its claim behind it; otherwise it goes back uncounted,
// and claims wait until what is ahead is answered and written, so that
// the next claim brings it first. It goes out once nothing else is out,
// no claim runs and every write is done, and nothing is handed out or
// claimed beside it, while it waits, or until its own verdict is written.
// Kept behind a fresh row it was counted while it waited, and a crash of
// that row's handler counted it again; handed out after its ack but
// before the ack was written, the next row's crash lost that ack.
func TestRedeliveredRowRunsAloneWithMaxDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4; c.MaxDeliveries = 3 })
	claim := func(rows ...*delivery) {
		t.Helper()
		req := b.sub.claims.scan.request(4, b.sub.claims.gen, time.Now())
		b.sub.claims.claiming = true
		for _, d := range rows {
			d.token = req.token
		}
		b.sub.onClaimed(claimResult{req: req, rows: rows, last: scanEnd{id: pgtype.Int8{Int64: rows[len(rows)-1].id, Valid: true}}})
	}
	row := func(id int64, deliveries int) *delivery {
		return &delivery{claimedRow: claimedRow{id: id, deliveries: deliveries, uuid: "u", payload: []byte("p"),
			metaRaw: []byte(`{}`), availableAt: time.Unix(id, 0)}}
	}
	canClaim := func() bool {
		t.Helper()
		b.sub.claims.want = true
		b.sub.startClaim(time.Now())
		defer func() { b.sub.claims.claiming = false }()
		return b.sub.claims.claiming
	}
	fresh, suspect, other, fresh2 := row(1, 1), row(2, 2), row(3, 2), row(4, 1)
	claim(fresh, suspect, other, fresh2)
	require.Equal(t, []*delivery{fresh}, b.sub.hand.buffer, "a redelivered row is not kept behind another")
	require.Equal(t, []returnOp{{d: suspect, undo: 1, giveBack: true}, {d: other, undo: 1, giveBack: true}, {d: fresh2, undo: 1, giveBack: true}},
		b.sub.writes.pending.returns, "it goes back, uncounted, with the rest of the claim")
	require.False(t, canClaim(), "no claim while what is ahead of it runs: it would come behind it again")
	b.sub.dispatch(time.Now())
	require.Zero(t, b.sub.hand.handed, "nothing goes out before the give-back is written: a crash would count it")
	b.written()
	b.sub.dispatch(time.Now())
	require.Equal(t, 1, b.sub.hand.handed, "the fresh row goes out")
	require.False(t, canClaim())
	b.sub.onVerdict(verdict{d: fresh, seq: fresh.seq, ack: true}, false)
	require.False(t, canClaim(), "not before its ack is written")
	b.written()
	require.True(t, canClaim(), "then the next claim brings the redelivered row first")

	suspect, other, fresh2 = row(2, 2), row(3, 2), row(4, 1)
	claim(suspect, other, fresh2)
	require.Equal(t, []*delivery{suspect}, b.sub.hand.buffer, "one redelivered row is kept, with nothing ahead")
	require.Equal(t, []returnOp{{d: other, undo: 1, giveBack: true}, {d: fresh2, undo: 1, giveBack: true}}, b.sub.writes.pending.returns,
		"the rest of the claim goes back, uncounted")
	require.False(t, canClaim(), "no claim while it waits: the claim's rows would be counted beside it")
	b.sub.dispatch(time.Now())
	require.Equal(t, 0, b.sub.hand.handed, "not before the writes are done: a crash would count the give-back's rows")
	b.written()
	b.sub.claims.claiming = true // a claim started before it was kept
	b.sub.dispatch(time.Now())
	require.Equal(t, 0, b.sub.hand.handed, "not while a claim runs: it counts its rows")
	b.sub.claims.claiming = false
	b.sub.dispatch(time.Now())
	require.Equal(t, 1, b.sub.hand.handed)
	require.Same(t, suspect, b.sub.hand.alone.row)
	require.False(t, canClaim(), "no claim while it runs: a claimed row counts a delivery")

	b.sub.onVerdict(verdict{d: suspect, seq: suspect.seq, ack: true}, false)
	b.sub.dispatch(time.Now())
	require.Equal(t, 0, b.sub.hand.handed)
	require.False(t, canClaim(), "nor before its ack is written: a crash beside it would lose the ack")
	b.written()
	require.True(t, canClaim(), "claims start again once its ack is written")
}

// With MaxDeliveries, a claim made while messages are out leases only rows
// never delivered (claimsFreshOnly), and one that passed over a row
// delivered before stops claims until what is out is answered and
// written; the next claim, not fresh only, scans from the start at once.
// Leased beside the messages out, the row was counted, and a crash of one
// of them before it went back counted it again.
func TestClaimsWhileMessagesAreOutLeaveRowsDeliveredBefore(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4; c.MaxDeliveries = 3 })
	start := func() (claimRequest, bool) {
		t.Helper()
		b.sub.claims.want = true
		b.sub.startClaim(time.Now())
		if !b.sub.claims.claiming {
			return claimRequest{}, false
		}
		b.sub.claims.claiming = false
		return b.sub.claims.scan.request(4, b.sub.claims.gen, time.Now()), true
	}
	require.False(t, b.sub.claimsFreshOnly(), "nothing out: every row")
	b.claimed(t, 1)
	require.True(t, b.sub.claimsFreshOnly(), "a row buffered")
	d := b.handOut(t)
	require.True(t, b.sub.claimsFreshOnly(), "a row out")

	req, ok := start()
	require.True(t, ok)
	req.freshOnly = true
	b.sub.claims.scan.from.at, b.sub.claims.scan.from.id = pgtype.Timestamptz{Time: time.Now(), Valid: true}, 7
	b.sub.claims.claiming = true
	b.sub.onClaimed(claimResult{req: req, passed: true})
	require.True(t, b.sub.hand.alone.behind)
	require.Equal(t, scanFromStart, b.sub.claims.scan.from.at, "the next claim scans from the start")
	_, ok = start()
	require.False(t, ok, "no claim while the message out runs")
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
	_, ok = start()
	require.False(t, ok, "nor before its ack is written")
	b.written()
	require.False(t, b.sub.claimsFreshOnly())
	b.sub.claims.want = true
	b.sub.startClaim(time.Now())
	require.True(t, b.sub.claims.claiming, "then at once, for every row")
}

// A write that meets a row changed under it (a serialization failure: a
// rotation or a conversion moved the row) is retried quietly, at debug
// level, the first quietConflicts times in a row, as a claim is; other
// failures, and conflicts past that, are errors.
func TestOwnerWriteConflictsAreQuietAtFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 4 })
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	b.claimed(t, 1)
	d := b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
	fail := func(err error) {
		job := b.sub.writes.pending
		b.sub.writes.pending = writeJob{}
		b.sub.writes.inWrite = true
		b.sub.onWritten(writeResult{job: job, left: job, err: err, done: written{}, abandoned: map[*delivery]error{}})
		b.sub.writes.gate.pass(time.Now().Add(time.Hour))
	}
	errorsLogged := func() int { return len(logs.Captured()[watermill.ErrorLogLevel]) }
	conflict := &pgconn.PgError{Code: "40001", Message: "tuple to be locked was already moved to another partition due to concurrent update"}
	for range quietConflicts {
		fail(conflict)
	}
	require.Zero(t, errorsLogged(), "a conflict is retried quietly at first")
	require.Equal(t, []*delivery{d}, b.sub.writes.pending.acks, "the ack stays pending")
	fail(conflict)
	require.Equal(t, 1, errorsLogged(), "conflicts in a row past quietConflicts are errors")
	b.written()
	require.Equal(t, finished, d.state)

	b.claimed(t, 2)
	d = b.handOut(t)
	b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
	fail(errors.New("connection reset"))
	require.Equal(t, 2, errorsLogged(), "any other failure is an error at once")
}

// A renewal round renews only the leases that would end before the round
// after next, with a quarter lease to spare: a young lease is left alone,
// so a short handler never finds its row changed under it (which a
// transactional handler under REPEATABLE READ fails on). A row to stamp
// anew is renewed whatever its age.
func TestOwnerRenewalLeavesYoungLeasesAlone(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *SubscriberConfig) { c.MaxInFlight = 2 })
	b.sub.claims.pf.disabled = true // a row waits beside no answer for seconds: kept here, renewed
	b.claimed(t, 1, 2)
	d := b.handOut(t)
	now := time.Now()
	d.stamp = b.sub.holder() // stamped as the process is now
	for other := range b.sub.hand.rows {
		other.stamp = d.stamp
	}
	b.sub.house.nextRenew = now
	b.sub.housekeeping(now)
	require.Empty(t, b.sub.writes.pending.renew, "leases just taken run for a whole lease")

	later := now.Add(b.sub.cfg.Lease/4 + time.Second)
	b.sub.house.nextRenew = later
	b.sub.housekeeping(later)
	require.Len(t, b.sub.writes.pending.renew, 2, "a lease older than a quarter would end before the round after next")

	b.sub.writes.pending.renew = nil
	b.sub.house.nextRenew = now.Add(time.Hour)
	d.stamp = pgtype.Int8{Int64: 42, Valid: true} // a key the process no longer holds
	b.sub.housekeeping(now)
	require.Equal(t, []*delivery{d}, b.sub.writes.pending.renew, "a row to stamp anew is renewed at once")
}

// With large rows the prefetch is bounded by size: a rate measured over a
// burst of acks made a claim of 1 MiB rows read ~200 of them, and a
// subscription with MaxInFlight 128 hold 500 MB. A claim and the rows
// held beyond the handlers stay within maxPrefetchBytes, its handlers'
// rows apart; small rows are bounded by count as before.
func TestPrefetchIsBoundedBySize(t *testing.T) {
	t.Parallel()
	now := time.Now()
	rows := func(n, size int) []*delivery {
		out := make([]*delivery, n)
		for i := range out {
			out[i] = &delivery{claimedRow: claimedRow{payload: make([]byte, size)}}
		}
		return out
	}
	p := newPrefetch(128, true, now)
	require.Equal(t, 128, p.claimSize(0, now, false), "before any claim: the free slots")
	p.claimed(rows(10, 1<<20))
	p.verdicts(1000) // a burst: 100k/s
	now = now.Add(10 * time.Millisecond)
	n := p.claimSize(0, now, false)
	require.Equal(t, 16, n, "a claim of 1 MiB rows reads 16 MiB at most")
	require.Zero(t, p.claimSize(128+16, now, false), "the handlers' rows and 16 MiB held: no claim")

	small := newPrefetch(16, true, now)
	small.claimed(rows(100, 200))
	small.verdicts(1000)
	require.Equal(t, maxClaim, small.claimSize(0, now.Add(10*time.Millisecond), false), "small rows: capped by count")
}

// A failed release of lost claims whose leases have all ended is given
// up, and said so: not logged as retried (with "tries=0").
func TestAReleaseGivenUpIsNotLoggedAsRetried(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	logs := watermill.NewCaptureLogger()
	b.sub.logger = logs
	long := time.Now().Add(-2 * b.sub.cfg.Lease)
	req := b.sub.claims.start(10, long, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	b.sub.claims.failed(claimResult{req: req, err: errors.New("connection reset")}, long)
	require.Len(t, b.sub.claims.lost.list, 1)
	b.sub.onReleasedClaims(b.sub.claims.lost.releasable(time.Now()), errors.New("connection refused"), time.Now())
	require.Empty(t, b.sub.claims.lost.list)
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		t.Errorf("logged at ERROR: %s %v", m.Msg, m.Fields)
	}
	require.Len(t, logs.Captured()[watermill.InfoLogLevel], 1)
}

// At close, the owner wakes when its last writes' deadline passes, not
// when a write's backoff ends: a write failing on and on (not for want of
// a connection) made Close give up a backoff after its deadline, seconds
// past StatementTimeout.
func TestOwnerWakesAtTheLastWritesDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	now := time.Now()
	b.sub.drain.stopping = true
	b.sub.writes.finalDeadline = now.Add(time.Second)
	b.sub.writes.gate.until = now.Add(5 * time.Second)
	b.sub.house.next = now.Add(time.Minute)
	b.sub.armTimer(now)
	require.Equal(t, b.sub.writes.finalDeadline, b.sub.events.timer.at)
	require.True(t, b.sub.finishedStopping(b.sub.writes.finalDeadline), "it gives up then")
}

// An ack whose reply was lost may have been applied: written again, it
// finds its row gone, most likely its own work. That is not reported as a
// lease lost to another consumer (a connection lost under a busy
// subscription printed a warning per acked row that another consumer had
// claimed it): one line for the write says what it may be. A row still
// there, or an ack the server refused or never got, is a lease lost.
func TestAckWrittenAgainAfterALostReplyIsNotALostLease(t *testing.T) {
	for _, c := range []struct {
		name    string
		err     error
		present bool
		phase   string
		logged  string
	}{
		{"ReplyLost", fmt.Errorf("ack: %w", io.ErrUnexpectedEOF), false, "ack_unanswered", "found their rows gone"},
		{"DeadlinePassed", fmt.Errorf("ack: %w", context.DeadlineExceeded), false, "ack_unanswered", "found their rows gone"},
		{"ReplyLostRowThere", fmt.Errorf("ack: %w", io.ErrUnexpectedEOF), true, "ack", "Lease lost"},
		{"Refused", &pgconn.PgError{Code: "40001", Message: "could not serialize access"}, false, "ack", "Lease lost"},
		{"NoConnection", &poolWait{errors.New("no connection in time")}, false, "ack", "Lease lost"},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := setup(t, func(cfg *SubscriberConfig) { cfg.MaxInFlight = 2 })
			logs := watermill.NewCaptureLogger()
			b.sub.logger = logs
			b.claimed(t, 1)
			d := b.handOut(t)
			b.sub.onVerdict(verdict{d: d, seq: d.seq, msg: d.msg, ack: true}, false)
			job := b.sub.writes.pending
			require.Equal(t, []*delivery{d}, job.acks)
			b.sub.writes.pending = writeJob{}
			b.sub.onWritten(writeResult{job: job, left: job, err: c.err, done: written{}, sent: time.Now()})
			again := b.sub.writes.pending
			require.Equal(t, []*delivery{d}, again.acks, "written again")
			b.sub.writes.pending = writeJob{}
			b.sub.onWritten(writeResult{job: again, done: written{}, sent: time.Now(), present: map[int64]bool{d.id: c.present}})
			require.Equal(t, finished, d.state)
			require.Equal(t, 1, b.eventCount(EventLeaseLost))
			require.Equal(t, []string{c.phase}, b.events.phases)
			warned := logs.Captured()[watermill.InfoLogLevel]
			require.Len(t, warned, 1, "one warning")
			require.Contains(t, warned[0].Msg, c.logged)
		})
	}
}
