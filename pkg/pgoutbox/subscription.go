package pgoutbox

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
)

// subscription is one Subscribe call. One goroutine, the owner (run),
// holds all of its state, in parts that each keep their own fields:
//
//   - claims (claim_schedule.go): when to claim, how many rows, from where;
//     claims.go starts them and takes in their rows;
//   - hand (handout.go): the rows we hold, the buffer, what is handed out;
//   - writes (writes.go): verdicts waiting for the completer, its pacing;
//   - house (housekeeping.go): ack deadlines, stalled buffers, renewals;
//   - drain (shutdown.go): stopping and the drain;
//   - held (held.go): the held path's open batches and when to hold.
//
// Code that runs beside the owner keeps no state of the subscription: it
// gets a request and returns a result over reports (the claimer runs claim
// statements, the completer writes batches, batch ends commit held
// transactions) or the inbox (the slots' verdicts, handlers' unhold
// requests). Nothing is shared under a lock, so there is no lock order to
// get wrong, and one row is in exactly one state (deliveryState) at a time.
type subscription struct {
	s      *Subscriber
	cfg    *SubscriberConfig
	topic  string
	logger watermill.LoggerAdapter

	// The plumbing: what the owner waits on, where messages leave for the
	// Router, and the stateless runners it sends requests to.
	events  ownerEvents
	outlet  outlet
	runners runners

	// The owner's state, in parts.
	claims claimSchedule
	hand   handout
	writes writeQueue
	house  housekeeping
	drain  drain
	held   heldPath
}

// ownerEvents are what the owner's select waits on besides its hand-outs:
// the reports of the goroutines beside it (results, wake-ups, stops), its
// one timer, and the slots' verdicts.
type ownerEvents struct {
	reports    chan report // results of the claimer, the completer and batch ends; signals
	signals    signals     // wake-ups and stop signals, forwarded as reports
	timer      ownerTimer
	inbox      *verdictInbox
	verdictBuf []verdict // the owner's buffer for the verdicts it takes from inbox
}

// outlet is where messages leave for the Router: the output channel, and
// the slots that send on it when MaxInFlight > 1, with what each message
// is built from.
type outlet struct {
	out    chan *message.Message
	slots  *slots          // MaxInFlight > 1; nil: the owner hands out itself
	parent context.Context // the parent of message contexts (messageParent)
	origin *origin         // topic and group, for DeliveryOf (read by handlers)
}

// runners run the statements of a subscription on goroutines beside the
// owner: each takes a request and returns a result, and keeps no state of
// the subscription.
type runners struct {
	claimer   *claimer
	completer *completer
	ender     *batchEnder
}

// report is what the claimer, the completer, a batch end or the signals
// send the owner: one channel for all keeps the owner's select small.
type report struct {
	claim *claimResult
	write *writeResult
	batch *batchResult
	stop  bool // the Subscribe context ended or the Subscriber closes
	// none of them: the notifier woke the subscription (waiter.Take says why)
}

// verdict is a handler's answer for a delivery, sent by its slot.
type verdict struct {
	d        *delivery
	seq      uint32           // the hand-out it answers: a late answer of an earlier one is ignored
	msg      *message.Message // the message handed out (its metadata after the handler)
	poison   error            // the row did not decode (a slot found out)
	ack      bool
	unsent   bool // the subscription stopped before the Router took the message
	timedOut bool // no Ack or Nack within AckDeadline
}

func newSubscription(s *Subscriber, ctx context.Context, topic string, waiter *notifier.Waiter, clock serverClock) *subscription {
	now := time.Now()
	reports := make(chan report, 3+maxHeldBatches) // one claim, one write, one signal and the held batches' ends
	sub := &subscription{
		s:      s,
		cfg:    &s.cfg,
		topic:  topic,
		logger: s.logger.With(watermill.LogFields{"topic": topic}),
		events: ownerEvents{
			reports: reports,
			signals: newSignals(ctx, s.closing, waiter, reports),
			timer:   newOwnerTimer(),
			inbox:   newVerdictInbox(),
		},
		outlet: outlet{
			out:    make(chan *message.Message),
			parent: messageParent(ctx),
			origin: &origin{topic: topic, group: s.cfg.ConsumerGroup},
		},
		claims: newClaimSchedule(&s.cfg, now, clock),
		hand:   handout{rows: map[*delivery]struct{}{}, guard: newRowGuard()},
		writes: writeQueue{gate: newRetryGate()},
		house:  housekeeping{nextRenew: now.Add(s.cfg.Lease / 2)},
		held:   heldPath{forced: testhook.ClaimPath(s.cfg.WorkerID), cfg: &s.cfg},
	}
	if s.cfg.MaxInFlight > 1 {
		// Slots take the next message without waiting for the owner, as
		// the claim fills the queue (see slotQueue).
		sub.outlet.slots = newSlots(s.cfg.MaxInFlight, s.cfg.MaxInFlight+slotQueue, sub.events.inbox,
			slotEnv{out: sub.outlet.out, parent: sub.outlet.parent, ackDeadline: s.cfg.AckDeadline,
				offerCheck: max(min(s.cfg.Lease/8, time.Second), 10*time.Millisecond), handedOut: s.obs.handedOut})
	}
	completer := newCompleter(s.pool, s.q, &s.cfg, topic, s.facts.isolate, reports)
	sub.runners = runners{
		completer: completer,
		ender:     &batchEnder{q: s.q, cfg: &s.cfg, topic: topic, stmtCtx: completer.stmtCtx},
		claimer:   &claimer{pool: s.pool, q: s.q, cfg: &s.cfg, topic: topic, isolate: s.facts.isolate, stop: sub.events.signals.stopCtx},
	}
	return sub
}

// ordered reports whether the subscription keeps publish order: one message
// at a time, a nacked one delivered again before any later one.
func (sub *subscription) ordered() bool { return sub.cfg.MaxInFlight == 1 }

// run is the owner goroutine. It returns after the output channel is closed.
//
// Its select has few cases on purpose: in a drain the owner parks there for
// nearly every message, and a select costs in proportion to its channels.
// So every timed event (idle wake, retry, backoffs, housekeeping, end of the
// drain) shares one timer, and the stop signals one channel.
func (sub *subscription) run() {
	defer sub.s.subs.Done()
	// The loops beside the owner, started before it and stopped after it
	// in reverse order: the slots first (then none sends on out), the
	// signals, the completer (idle by then: the owner waited for its
	// writes).
	loops := []background{sub.runners.completer, &sub.events.signals}
	if sub.outlet.slots != nil {
		loops = append(loops, sub.outlet.slots)
	}
	for _, l := range loops {
		l.start()
	}
	sub.house.next = time.Now().Add(housekeepingEvery(sub.cfg))
	fast := 0

	for {
		now := time.Now()
		sub.passedTimes(now)
		sub.startClaim(now)
		if sub.drain.stopping && sub.finishedStopping(now) {
			break
		}
		var head *delivery
		var sendC chan *message.Message
		if sub.outlet.slots != nil {
			sub.dispatch(now)
		} else {
			head, sendC = sub.nextMessage(now)
		}
		// After the hand-out, which queues writes of its own (an ordered
		// retry's count when its delay ends, the dead letter of a row over
		// MaxDeliveries): started before it, they waited for the owner's
		// next event, up to a second of housekeeping.
		sub.startWrite(now)
		var msg *message.Message // select evaluates every send's value, also on a nil channel
		if head != nil {
			msg = head.msg
		}
		var ackC, nackC <-chan struct{}
		var single *message.Message
		if sub.hand.single != nil {
			single = sub.hand.single.msg
			ackC, nackC = single.Acked(), single.Nacked()
		}
		// Fast path while busy: hand out and take verdicts without the
		// full select, a bounded number of turns so timers and stops are
		// never starved.
		if fast < maxFastTurns {
			fast++
			select {
			case sendC <- msg:
				sub.handedOut(head)
				continue
			case <-sub.events.inbox.wake:
				sub.takeVerdicts()
				continue
			case <-ackC:
				sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single, ack: true}, false)
				continue
			case <-nackC:
				sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single}, false)
				continue
			default:
			}
		}
		fast = 0
		sub.armTimer(now)

		select {
		case sendC <- msg:
			sub.handedOut(head)
		case <-sub.events.inbox.wake:
			sub.takeVerdicts()
		case <-ackC:
			sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single, ack: true}, false)
		case <-nackC:
			sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single}, false)
		case r := <-sub.events.reports:
			poolClosed := sub.poolClosedBy(r)
			switch {
			case r.claim != nil:
				sub.onClaimed(*r.claim)
			case r.write != nil:
				sub.onWritten(*r.write)
			case r.batch != nil:
				sub.finishedBatch(*r.batch)
			case r.stop:
				if !sub.drain.stopping {
					sub.beginStop()
				}
			default:
				k := sub.events.signals.waiter.Take()
				sub.claims.notified(k)
				if k.Arrived {
					sub.arrived(time.Now())
				}
				if k.Connected {
					sub.writes.gate.serverBack(time.Now())
				}
				if k.LockChanged {
					sub.lockChanged(time.Now())
				}
			}
			if poolClosed && !sub.drain.stopping {
				sub.beginStop()
			}
		case <-sub.events.timer.t.C:
			sub.events.timer.fired() // passedTimes acts on it
		}
	}
	sub.abandonLost() // a slot waiting for a lost row's handler would hold up the stop
	for i := len(loops) - 1; i >= 0; i-- {
		loops[i].stop()
	}
	sub.s.subscriptionEnded(sub.topic) // before the close: a caller that saw it may close the pool
	close(sub.outlet.out)
	sub.logger.Debug("Subscription closed", nil)
}

// background is the one start/stop shape of a loop that runs beside the
// owner: start launches its goroutines, stop returns once they are gone.
type background interface {
	start()
	stop()
}

var (
	_ background = (*completer)(nil)
	_ background = (*signals)(nil)
	_ background = (*slots)(nil)
)

// maxFastTurns bounds the owner's turns on the fast path (see run).
const maxFastTurns = 64

// armTimer points the owner's one timer at the next timed event still to
// come. Events already due were handled by passedTimes: arming a timer for
// them would make the loop spin.
func (sub *subscription) armTimer(now time.Time) {
	var at time.Time
	earliest := func(t time.Time) {
		if t.After(now) && (at.IsZero() || t.Before(at)) {
			at = t
		}
	}
	earliest(sub.claims.idleUntil)
	earliest(sub.claims.scan.relooks.at)
	earliest(sub.house.next)
	earliest(sub.drain.end)
	earliest(sub.writes.gate.until)
	earliest(sub.writes.ackWait)
	earliest(sub.claims.gate.until)
	earliest(sub.claims.lost.recheckAt())
	earliest(sub.writes.finalDeadline) // Close gives up its last writes then, not after a backoff past it
	sub.held.nextEvent(earliest)
	if sub.hand.retry != nil && sub.hand.retry.holdDone {
		earliest(sub.hand.retry.retryAt.time())
	}
	sub.events.timer.point(at, now)
}

// passedTimes acts on the timed events that are due: the end of an idle
// sleep, of a backoff, of the drain, and housekeeping.
func (sub *subscription) passedTimes(now time.Time) {
	if !sub.claims.idleUntil.IsZero() && !now.Before(sub.claims.idleUntil) {
		sub.claims.wake(true) // the sleep may have been set to a lease expiry
	}
	if at := sub.claims.scan.relooks.at; !at.IsZero() && !now.Before(at) && !sub.claims.want {
		sub.claims.wake(false) // a later look for a vanished holder's rows
	}
	sub.claims.gate.pass(now)
	sub.writes.gate.pass(now)
	if !now.Before(sub.house.next) {
		sub.housekeeping(now)
		sub.house.next = now.Add(housekeepingEvery(sub.cfg))
	}
	if !sub.drain.end.IsZero() && !now.Before(sub.drain.end) {
		sub.drain.end = time.Time{}
		sub.endDrain(true)
	}
	if len(sub.held.batches) > 0 {
		sub.tendBatches(now)
	}
}
