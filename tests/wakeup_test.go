package tests

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// The idle poll of these tests is 30s (24s at the least, with jitter) and
// a message is awaited for at most wakeBound, far below it: a message that
// arrives within the bound was not brought by a poll.
const (
	idlePoll  = 30 * time.Second
	wakeBound = 10 * time.Second
)

func idleSubscriber(ev *events) func(c *pgoutbox.SubscriberConfig) {
	return func(c *pgoutbox.SubscriberConfig) {
		c.MinPollInterval, c.MaxPollInterval, c.Lease = idlePoll, idlePoll, 2*idlePoll
		c.Observer = ev
	}
}

// waitEmptyClaim waits for a claim that found nothing: the loop is asleep
// until its poll, a NOTIFY or a reconnect.
func waitEmptyClaim(t *testing.T, ev *events) {
	t.Helper()
	for ev.wait(t, pgoutbox.EventClaimed, wakeBound).Count != 0 {
	}
}

// Only the NOTIFY sent at commit can deliver a message to an idle
// subscriber before its poll. The first message makes sure the LISTEN
// connection is up (it may be brought by the wake-up every loop gets when
// that connection is established). Later ones can still be brought by a
// wake-up of every loop (another process's liveness lock vanished: other
// tests ending), so a second, idle topic of the same Subscriber is the
// control: an attempt counts only if the control loop did not claim
// meanwhile.
func TestIdleSubscriberIsWokenByNotify(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, idleSubscriber(ev))
	ch, err := sub.Subscribe(context.Background(), "wake")
	require.NoError(t, err)
	control, err := sub.Subscribe(context.Background(), "control")
	require.NoError(t, err)

	// idle waits until the loop of topic has made (at least) leased claims
	// that found rows, and then one that found nothing: it sleeps until a
	// poll or a wake-up. (That empty claim may come before the ack is
	// written: a claim needs a free slot, not a finished write.)
	idle := func(topic string, leased int) {
		t.Helper()
		pollUntil(t, "the "+topic+" loop goes idle", wakeBound, nil, func() bool {
			n, asleep := 0, false
			for _, e := range ev.snapshot() {
				if e.Topic == topic && e.Kind == pgoutbox.EventClaimed {
					asleep = e.Count == 0
					if e.Count > 0 {
						n++
					}
				}
			}
			return n >= leased && asleep
		})
	}

	idle("wake", 0)
	idle("control", 0)
	b.publishInTx(t, "wake", true, newMsg("first"))
	receive(t, ch, wakeBound).Ack()

	// Other tests' faults wake every loop of the database too (a liveness
	// lock that vanished): keep trying for a while, not a number of times.
	start, attempts := time.Now(), 0
	for attempt := 0; attempt < 10 || time.Since(start) < 40*time.Second; attempt++ {
		attempts++
		// Each message and mark so far was published alone and received
		// before the next: one claim leased it.
		idle("wake", 1+attempt)
		idle("control", attempt)
		from := len(ev.snapshot())
		b.publishInTx(t, "wake", true, newMsg("by notify"))
		m := receive(t, ch, wakeBound)
		require.Equal(t, "by notify", string(m.Payload))
		m.Ack()
		// A mark on the control topic: its claim comes after any claim
		// the control loop made while the message was on its way.
		b.publishInTx(t, "control", true, newMsg("mark"))
		receive(t, control, wakeBound).Ack()
		var marked bool
		var woken int // empty claims of the control loop before the mark's
		pollUntil(t, "the mark's claim is observed", wakeBound, func() {
			marked, woken = false, 0
			for _, e := range ev.snapshot()[from:] {
				if e.Topic != "control" || e.Kind != pgoutbox.EventClaimed {
					continue
				}
				if e.Count > 0 {
					marked = true
					break
				}
				woken++
			}
		}, func() bool { return marked })
		if woken == 0 {
			return // no wake-up of every loop: the NOTIFY brought it
		}
		t.Logf("attempt %d: every loop was woken meanwhile; again", attempt)
	}
	t.Fatalf("in %d attempts, a message never reached the idle loop without a wake-up of every loop", attempts)
}

// A NOTIFY wakes only the loops of its topic. B, an idle loop of another
// topic on the same LISTEN connection as A, must not claim for each of A's
// messages. Loops are also woken by things outside the test (when another
// process's liveness lock vanishes: other tests ending), so B is compared
// with C, an idle loop of another outbox table (another channel), which
// shares those wake-ups but can never see A's notifications.
func TestNotifyWakesOnlyItsTopic(t *testing.T) {
	t.Parallel()
	b, other := setup(t), setup(t)
	evA, evB, evC := newEvents(), newEvents(), newEvents()
	subA := b.subscriber(t, idleSubscriber(evA))
	chA, err := subA.Subscribe(context.Background(), "a")
	require.NoError(t, err)
	waitEmptyClaim(t, evA)
	// Once a message arrives, the shared LISTEN connection is up (it came
	// by NOTIFY or by the wake-up at connect), so B below registers on a
	// live connection.
	b.publishInTx(t, "a", true, newMsg("first"))
	receive(t, chA, wakeBound).Ack()
	evA.wait(t, pgoutbox.EventAcked, wakeBound)

	subB := b.subscriber(t, idleSubscriber(evB))
	chB, err := subB.Subscribe(context.Background(), "b")
	require.NoError(t, err)
	subC := other.subscriber(t, idleSubscriber(evC))
	chC, err := subC.Subscribe(context.Background(), "b")
	require.NoError(t, err)

	// Marks: a message to B and to C before A's messages and one after;
	// the empty claims between the two count the wake-ups.
	mark := func() {
		t.Helper()
		b.publishInTx(t, "b", true, newMsg("mark"))
		other.publishInTx(t, "b", true, newMsg("mark"))
		for _, ch := range []<-chan *message.Message{chB, chC} {
			receive(t, ch, wakeBound).Ack()
		}
	}
	mark()
	const n = 20
	for range n {
		b.publishInTx(t, "a", true, newMsg("again"))
		receive(t, chA, wakeBound).Ack()
		evA.wait(t, pgoutbox.EventAcked, wakeBound)
	}
	mark()

	wokenB, wokenC := emptyClaimsBetweenMarks(t, evB), emptyClaimsBetweenMarks(t, evC)
	t.Logf("empty claims between the marks: B %d, C %d", wokenB, wokenC)
	require.Less(t, wokenB, wokenC+n/2, "topic b's loop was woken by topic a's notifications")
}

// emptyClaimsBetweenMarks waits until the two claims that leased the marks
// were observed and returns the number of empty claims between them.
func emptyClaimsBetweenMarks(t *testing.T, ev *events) int {
	t.Helper()
	var counts []int
	pollUntil(t, "both marks' claims are observed", 30*time.Second, func() {
		counts = counts[:0]
		ev.mu.Lock()
		for _, e := range ev.list {
			if e.Kind == pgoutbox.EventClaimed {
				counts = append(counts, e.Count)
			}
		}
		ev.mu.Unlock()
	}, func() bool {
		leased := 0
		for _, c := range counts {
			if c > 0 {
				leased++
			}
		}
		return leased >= 2
	})
	empty, leased := 0, 0
	for _, c := range counts {
		switch {
		case c > 0:
			leased++
		case leased == 1:
			empty++
		}
		if leased == 2 {
			break
		}
	}
	return empty
}

// snapshot returns the events observed so far, in order.
func (e *events) snapshot() []pgoutbox.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]pgoutbox.Event(nil), e.list...)
}

// claimTimes records when a subscriber's claims took rows or found none.
type claimTimes struct {
	mu sync.Mutex
	at []time.Time
}

func (c *claimTimes) Observe(e pgoutbox.Event) {
	if e.Kind == pgoutbox.EventClaimed {
		c.mu.Lock()
		c.at = append(c.at, time.Now())
		c.mu.Unlock()
	}
}

// lastGap is the time between the last two claims (0 before two).
func (c *claimTimes) lastGap() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.at); n >= 2 {
		return c.at[n-1].Sub(c.at[n-2])
	}
	return 0
}

func (c *claimTimes) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.at)
}

// An idle subscription sleeps its idle polls out while another process
// holds its liveness lock: a live holder's key is no vanished one. (The
// checks once took every key another session held for a missing one, and
// woke every subscription to look for orphans at every check: 12 claims
// in 3 s.) Not parallel: the checks see the locks of the whole database,
// and tests that stop subscribers beside it make their keys vanish, which
// wakes it rightly.
func TestIdleSubscriptionIsNotWokenByAnotherProcessesLiveLock(t *testing.T) {
	b := setup(t)
	claims := &claimTimes{}
	cfg := func(obs pgoutbox.Observer) func(*pgoutbox.SubscriberConfig) {
		return func(c *pgoutbox.SubscriberConfig) {
			c.MinPollInterval, c.MaxPollInterval, c.Lease = 20*time.Millisecond, 5*time.Second, 30*time.Second
			c.Observer = obs
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := b.subscriberOn(t, b.namedPool(t, "idle-other"), cfg(nil)).Subscribe(ctx, "idle") // another process
	require.NoError(t, err)
	_, err = b.subscriberOn(t, b.namedPool(t, "idle-sub"), cfg(claims)).Subscribe(ctx, "idle")
	require.NoError(t, err)
	pollUntil(t, "the idle polls grew past a second", 20*time.Second, nil, func() bool { return claims.lastGap() >= time.Second })
	before := claims.count()
	time.Sleep(3 * time.Second) // six liveness checks
	require.LessOrEqual(t, claims.count()-before, 6, "an idle subscription was woken again and again")
}
