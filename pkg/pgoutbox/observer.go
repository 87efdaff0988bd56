package pgoutbox

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// EventKind names an event reported to an Observer.
type EventKind string

// Events the Router cannot see. Row events carry RowID; batch events
// (claimed, lease_renewed) carry Count.
const (
	EventClaimed      EventKind = "claimed"       // a claim leased Count rows (0: the loop goes idle)
	EventAcked        EventKind = "acked"         // an ack was written (row deleted)
	EventRetried      EventKind = "retried"       // a nack was written; the row is due again later
	EventReleased     EventKind = "released"      // a lease was given back (at shutdown, or a prefetched row waited too long)
	EventDeadLettered EventKind = "dead_lettered" // a terminal failure moved the row to the dead-letter table (or parked it, without one); see Reason
	EventLeaseLost    EventKind = "lease_lost"    // a write found its lease taken by someone else; see Phase
	EventLeaseRenewed EventKind = "lease_renewed" // Count in-flight leases were extended
	EventPoisoned     EventKind = "poisoned"      // a row could not be decoded into a message
	EventPublished    EventKind = "published"     // a Publish call inserted Count rows (in a transaction that may still roll back)
	EventHeldToLease  EventKind = "held_to_lease" // Count rows of a held claim became ordinary leases (see ClaimMode)
	EventHandedOut    EventKind = "handed_out"    // the Router took a message; see CreatedAt, DueAt, Lateness
)

// Paths a row takes (Event.Path): see ClaimMode.
const (
	PathLease = "lease" // claimed under a lease, written by its own statements
	PathHeld  = "held"  // locked in a held transaction, acked in it
)

// Failure reasons of dead-lettered rows, stored in failure_reason.
const (
	ReasonMaxDeliveries  = "max_deliveries"
	ReasonRetryExhausted = "retry_exhausted"
	ReasonRejected       = "rejected"
	ReasonPoisoned       = "poisoned"
)

// Event is one observation. Fields that do not apply to a kind are zero.
type Event struct {
	// Kind is what happened.
	Kind EventKind
	// Topic is the topic of the subscription or Publish call.
	Topic string
	// Group is the subscriber's consumer group ("" for the default group);
	// empty for publisher events.
	Group string
	// RowID is the outbox row's id, for the events of one row (acked,
	// retried, released, dead_lettered, lease_lost, poisoned, handed_out);
	// 0 for the events of a claim or call (claimed, lease_renewed,
	// held_to_lease, published).
	RowID int64
	// Deliveries is how many times the row was delivered, counting this
	// delivery, for the events of one row.
	Deliveries int
	// Count is how many rows a claimed, lease_renewed, held_to_lease or
	// published event concerns.
	Count int
	// Phase is the write that found the lease lost: "ack", "nack",
	// "release", "renew" or "dead_letter"; "commit" for a held batch
	// whose transaction did not commit (its connection was lost: nobody
	// took the rows, they are due again, and acked ones run again);
	// "ack_unanswered" for an ack written again after the reply to the
	// first was lost (its connection went) that found its row gone: most
	// likely the first had deleted it and the message ran once, unless
	// another consumer took the row meanwhile.
	Phase string
	// Reason is the failure reason of a dead-lettered row.
	Reason string
	// Path is the path of the claim (claimed), or of the row (acked,
	// released, handed_out): PathLease or PathHeld.
	Path string
	// Err is why a poisoned row could not be decoded; nil for the other
	// kinds.
	Err error
	// CreatedAt and DueAt are the row's publish time and the time it
	// became due (handed_out; see Delivery.PublishedAt and DueAt).
	CreatedAt, DueAt time.Time
	// Lateness is how long after DueAt the Router took the message
	// (handed_out), by this process's clock against the database's:
	// for a message neither delayed nor retried, the time from its
	// publish to its hand-out.
	Lateness time.Duration
}

// Observer receives events. Implementations must be safe for concurrent use
// and should not block. A Subscriber calls its Observer from a goroutine of
// its own, in the order the events happened, so a slow Observer delays the
// events, never the deliveries or the lease renewals; past 65,536
// waiting events, new ones are dropped (and the drop logged). A Publisher calls it in Publish. A panicking Observer is
// recovered and logged; delivery goes on.
type Observer interface {
	Observe(Event)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(Event)

// Observe calls f(e).
func (f ObserverFunc) Observe(e Event) { f(e) }

type safeObserver struct {
	o      Observer
	logger watermill.LoggerAdapter
}

func (s safeObserver) observe(e Event) {
	if s.o == nil {
		return
	}
	defer func() {
		if r := recover(); r != nil {
			s.logger.Error("pgoutbox observer panicked; event dropped", nil, watermill.LogFields{"event": string(e.Kind), "panic": r})
		}
	}()
	s.o.Observe(e)
}

// maxQueuedEvents bounds the events waiting for a slow Observer.
const maxQueuedEvents = 1 << 16

// eventQueue hands a Subscriber's events to its Observer on a goroutine of
// its own: the subscriptions' owners only append (a mailbox), so a slow
// Observer cannot hold up a renewal.
type eventQueue struct {
	obs     safeObserver
	mu      sync.Mutex
	q       []Event
	spare   []Event // the other buffer: the queue and the batch being observed swap
	dropped int
	// started: a goroutine runs. It starts at an event and, while the
	// Subscriber has no subscription (idle), ends once the queue is
	// empty: a subscriber that is not subscribed holds none, also one
	// left unclosed (a Router stopped by its context does not close its
	// subscribers, and each such subscriber kept its goroutine for good).
	started bool
	idle    bool
	closed  bool
	wake    chan struct{}
	done    chan struct{} // closed when the goroutine under way ends
	// abandon is set when close stopped waiting: the goroutine drops
	// what is left instead of observing it.
	abandon atomic.Bool
}

func newEventQueue(obs safeObserver) *eventQueue {
	return &eventQueue{obs: obs, wake: make(chan struct{}, 1), idle: true}
}

// setIdle tells the queue whether the Subscriber has no subscription
// now: its goroutine then ends once it has observed what is queued.
func (e *eventQueue) setIdle(idle bool) {
	e.mu.Lock()
	e.idle = idle
	running := e.started
	e.mu.Unlock()
	if idle && running {
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
}

func (e *eventQueue) observe(ev Event) {
	if e.obs.o == nil {
		return
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	if !e.started {
		e.started, e.done = true, make(chan struct{})
		go e.run(e.done)
	}
	if len(e.q) >= maxQueuedEvents {
		e.dropped++
		e.mu.Unlock()
		return
	}
	first := len(e.q) == 0
	e.q = append(e.q, ev)
	e.mu.Unlock()
	if first { // later ones find the goroutine woken already, or busy
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
}

// close delivers what is queued, waiting at most within, and stops the
// goroutine. What a slow Observer has not taken by then is dropped (and
// counted in a log line): Close must not wait for a queue of up to
// maxQueuedEvents at the Observer's pace (20 ms an event is 22 minutes).
// An Observe call under way may still return after close.
func (e *eventQueue) close(within time.Duration) {
	e.mu.Lock()
	e.closed = true
	started, done := e.started, e.done
	e.mu.Unlock()
	if !started {
		return // nothing queued: a goroutine ends only with the queue empty
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
	t := time.NewTimer(within)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		e.abandon.Store(true)
	}
}

func (e *eventQueue) run(done chan struct{}) {
	defer close(done)
	for {
		<-e.wake
		for {
			e.mu.Lock()
			batch, dropped := e.q, e.dropped
			e.q, e.dropped = e.spare[:0], 0
			e.mu.Unlock()
			if dropped > 0 {
				e.obs.logger.Error("Observer too slow; events dropped", nil, watermill.LogFields{"dropped": dropped})
			}
			for i, ev := range batch {
				if e.abandon.Load() {
					e.mu.Lock()
					left := len(batch) - i + len(e.q)
					e.mu.Unlock()
					e.obs.logger.Error("Observer too slow at Close; the events it had not taken are dropped", nil, watermill.LogFields{"dropped": left})
					return
				}
				e.obs.observe(ev)
			}
			clear(batch) // let go of the events' errors
			e.mu.Lock()
			e.spare = batch[:0]
			if len(batch) == 0 && len(e.q) == 0 && (e.closed || e.idle) {
				e.started = false // the next event starts another
				e.mu.Unlock()
				return
			}
			e.mu.Unlock()
			if len(batch) == 0 {
				break
			}
		}
	}
}
