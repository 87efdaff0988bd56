package pgoutbox

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// slots are the goroutines that hand messages to the Router beside the
// owner when MaxInFlight > 1, one per message in flight. A slot takes an
// item from the queue, builds its message, offers it to the Router, waits
// for its Ack or Nack (keeping the ack deadline) and leaves the verdict in
// the inbox. It reads nothing of the subscription but its slotItem and the
// slotEnv fixed at start: the owner keeps every decision.
type slots struct {
	queue chan slotItem // hand-outs in queue order; its capacity is the lease window
	halt  chan struct{} // closed when the subscription stops: nothing more is offered
	inbox *verdictInbox
	env   slotEnv
	n     int // slots to run: MaxInFlight
	wg    sync.WaitGroup
}

// slotEnv is what every slot reads, fixed before they start.
type slotEnv struct {
	out chan<- *message.Message
	// parent gives message contexts their values; not its cancellation
	// (see messageParent).
	parent      context.Context
	ackDeadline time.Duration // 0: none
	// offerCheck is how often a slot whose offer waits looks whether the
	// offer ended (outcome.offerBy); 0: every 100 ms.
	offerCheck time.Duration
	// handedOut reports that the Router took a message (EventHandedOut);
	// it must not block.
	handedOut func(*outcome)
}

// slotItem is a delivery for a slot, with what the slot may read of it.
type slotItem struct {
	d                *delivery // only passed back in the verdict
	seq              uint32
	uuid             string
	payload, metaRaw []byte
	orderingKey      string
	outcome          *outcome
	abandon          <-chan struct{} // closed when the owner stops waiting for the verdict
}

// slotQueue is how many messages beyond MaxInFlight wait in the slots'
// queue; the rest of a prefetch waits in the owner's buffer, where the
// owner takes it from as verdicts free the queue. The queue is allocated
// whole when a subscription starts (about 110 bytes an item, 4,096+ items
// would cost a service of 60 handlers 27 MB), and a thousand messages
// ready is far more than slots take while the owner wakes for verdicts.
const slotQueue = 1024

func newSlots(n, window int, inbox *verdictInbox, env slotEnv) *slots {
	return &slots{queue: make(chan slotItem, window), halt: make(chan struct{}), inbox: inbox, env: env, n: n}
}

// start runs the slots.
func (s *slots) start() {
	for range s.n {
		s.wg.Add(1)
		go s.run()
	}
}

// hand queues an item; the owner never queues more than the capacity.
func (s *slots) hand(it slotItem) { s.queue <- it }

// capacity is how many items the queue holds.
func (s *slots) capacity() int { return cap(s.queue) }

// queued is how many items wait for a slot.
func (s *slots) queued() int { return len(s.queue) }

// takeQueued takes back, in queue order, the items no slot took yet.
func (s *slots) takeQueued() []slotItem {
	var out []slotItem
	for {
		select {
		case it := <-s.queue:
			out = append(out, it)
		default:
			return out
		}
	}
}

// stopOffering makes every slot report what it has not offered yet as
// unsent.
func (s *slots) stopOffering() { close(s.halt) }

// stop stops the slots once they are idle; none sends on out afterwards.
func (s *slots) stop() {
	close(s.queue)
	s.wg.Wait()
}

func (s *slots) run() {
	defer s.wg.Done()
	// One timer per slot, armed for each message in turn (the ack
	// deadline), and a ticker for offers that wait: a timer armed for each
	// offer would cost every message a timer's reset.
	var deadline *time.Timer
	if s.env.ackDeadline > 0 {
		deadline = time.NewTimer(time.Hour)
		deadline.Stop()
		defer deadline.Stop()
	}
	every := s.env.offerCheck
	if every <= 0 {
		every = 100 * time.Millisecond
	}
	offerCheck := time.NewTicker(every)
	defer offerCheck.Stop()
	for it := range s.queue {
		if v, ok := s.handle(it, deadline, offerCheck.C); ok {
			s.inbox.put(v)
		}
	}
}

// handle offers one item and waits for its verdict; ok is false when the
// owner abandoned it and wants no verdict.
func (s *slots) handle(it slotItem, deadline *time.Timer, offerCheck <-chan time.Time) (v verdict, ok bool) {
	v = verdict{d: it.d, seq: it.seq}
	msg, cancel, err := buildMessage(s.env.parent, it.uuid, it.payload, it.metaRaw, it.orderingKey, it.outcome)
	if err != nil {
		v.poison = err
		return v, !closed(it.abandon)
	}
	// An answer, a deadline or an abandonment ends the message's context,
	// and so does the owner, for a row lost while its handler runs.
	defer cancel()
	it.outcome.setCancel(cancel)
	v.msg = msg
	// Checked before the offer: a select whose send is ready too picks at
	// random, and an abandoned or stopped message must not reach the
	// Router. (Only a stop that comes while the offer waits can lose the
	// race to a Router that takes the message at that very moment; then
	// the message counts as handed out.)
	// A message whose context the owner ended (its row was lost while the
	// item waited) goes back unsent: the owner waits for that answer.
	// So does one whose lease may have passed while it waited (the process
	// was frozen longer than the Lease): another consumer may have taken
	// the row, and even handled the key's next messages.
	switch {
	case closed(it.abandon):
		return v, false
	case closed(s.halt), msg.Context().Err() != nil, it.outcome.offerEnded(time.Now()):
		v.unsent = true
		return v, true
	}
	select {
	case s.env.out <- msg: // the Router was waiting: no select of every case
		s.env.handedOut(it.outcome)
	default:
		if v, ok, sent := s.offer(it, msg, v, offerCheck); !sent {
			return v, ok
		}
	}
	var expired <-chan time.Time
	if deadline != nil {
		deadline.Reset(s.env.ackDeadline)
		defer deadline.Stop()
		expired = deadline.C
	}
	for {
		select {
		case <-msg.Acked():
			v.ack = true
		case <-msg.Nacked():
		case <-expired:
			if it.outcome.completingInTx() {
				// The handler's transaction is completing the row (bounded
				// by its commit timeout): its answer decides, a nack now
				// would only race it. Look again shortly: if it rolls back,
				// the deadline still applies.
				deadline.Reset(completingRecheck(s.env.ackDeadline))
				continue
			}
			v.timedOut = true
		case <-it.abandon:
			return v, false
		}
		return v, !closed(it.abandon)
	}
}

// offer waits until the Router takes msg (sent), or until the offer ends
// without it: the subscription stops, the owner abandons the item, the
// message's context ends, or its lease may have passed (checked at each
// tick of offerCheck: a frozen process finds it passed when it resumes).
// v and ok are then the item's verdict.
func (s *slots) offer(it slotItem, msg *message.Message, v verdict, offerCheck <-chan time.Time) (_ verdict, ok, sent bool) {
	for {
		select {
		case s.env.out <- msg:
			s.env.handedOut(it.outcome)
			return v, true, true
		case <-s.halt:
			v.unsent = true
			return v, !closed(it.abandon), false
		case <-it.abandon:
			return v, false, false
		case <-msg.Context().Done():
			v.unsent = true
			return v, true, false
		case now := <-offerCheck:
			if it.outcome.offerEnded(now) {
				v.unsent = true
				return v, true, false
			}
		}
	}
}

// completingRecheck is how long a deadline that found the handler's
// transaction completing waits before it looks again.
func completingRecheck(ackDeadline time.Duration) time.Duration {
	return max(ackDeadline/10, 10*time.Millisecond)
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// verdictInbox is where the slots leave verdicts, and handlers' transactions
// their unhold requests, for the owner: a mailbox, so a busy owner takes
// many per wake-up instead of being woken for each.
type verdictInbox struct {
	mu      sync.Mutex
	list    []verdict
	unholds []unholdRequest
	wake    chan struct{} // a value while a list is not empty
}

func newVerdictInbox() *verdictInbox { return &verdictInbox{wake: make(chan struct{}, 1)} }

func (in *verdictInbox) put(v verdict) {
	in.mu.Lock()
	in.list = append(in.list, v)
	in.mu.Unlock()
	in.notify()
}

func (in *verdictInbox) putUnhold(r unholdRequest) {
	in.mu.Lock()
	in.unholds = append(in.unholds, r)
	in.mu.Unlock()
	in.notify()
}

func (in *verdictInbox) notify() {
	select {
	case in.wake <- struct{}{}:
	default:
	}
}

// take moves the waiting verdicts into buf and returns them, with the
// unhold requests.
func (in *verdictInbox) take(buf []verdict) ([]verdict, []unholdRequest) {
	in.mu.Lock()
	buf = append(buf[:0], in.list...)
	// Cleared, not only cut: the array is kept for the next verdicts, and
	// those it held would keep their messages (payloads of megabytes) alive
	// while the subscription idles.
	clear(in.list)
	in.list = in.list[:0]
	unholds := in.unholds
	in.unholds = nil
	in.mu.Unlock()
	return buf, unholds
}

// unholdRequest asks the owner to make a held row a lease at once: a
// handler's transaction is about to delete it (tx.Middleware), and its
// DELETE would wait for the held transaction's lock until then. The owner
// closes done once the row is a lease (or gone).
type unholdRequest struct {
	d    *delivery
	done chan struct{}
}
