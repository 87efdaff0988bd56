package pgoutbox

import (
	"context"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// signals forwards what reaches a subscription from outside — the
// notifier's wake-ups, the end of the Subscribe context, the Subscriber's
// Close — to the owner as reports, so the owner's select waits on few
// channels. Its goroutine keeps no state but the channels it reads.
type signals struct {
	ctx     context.Context // the Subscribe context
	closing <-chan struct{} // closed by the Subscriber's Close
	waiter  *notifier.Waiter
	// stopCtx ends when the subscription stops: reads that only plan
	// (nextDue) stop waiting for the database then.
	stopCtx    context.Context
	cancelStop context.CancelFunc
	done       chan struct{} // closed when the owner returns: the forwarder ends, waiting handlers' transactions let go (unhold)
	gone       chan struct{} // closed by the forwarder as it returns
	reports    chan<- report
}

func newSignals(ctx context.Context, closing <-chan struct{}, waiter *notifier.Waiter, reports chan<- report) signals {
	stopCtx, cancel := context.WithCancel(context.Background())
	return signals{ctx: ctx, closing: closing, waiter: waiter, stopCtx: stopCtx, cancelStop: cancel,
		done: make(chan struct{}), gone: make(chan struct{}), reports: reports}
}

// start forwards signals to the reports until stop.
func (g *signals) start() { go g.forward(g.reports) }

// stop stops the waiter and the forwarder, and tells waiting handlers'
// transactions (unhold) that the subscription is gone; it returns once the
// forwarder has.
func (g *signals) stop() {
	g.waiter.Stop()
	close(g.done)
	<-g.gone
}

func (g *signals) forward(reports chan<- report) {
	defer close(g.gone)
	stop, closing := g.ctx.Done(), g.closing
	for {
		var r report
		select {
		case <-g.done:
			return
		case <-g.waiter.C:
		case <-stop:
			r.stop, stop, closing = true, nil, nil
		case <-closing:
			r.stop, stop, closing = true, nil, nil
		}
		select {
		case reports <- r:
		case <-g.done:
			return
		}
	}
}

// ownerTimer is the owner's one timer, pointed at the next timed event.
type ownerTimer struct {
	t  *time.Timer
	at time.Time // what it is set for; zero: stopped
}

func newOwnerTimer() ownerTimer {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return ownerTimer{t: t}
}

// point sets the timer for at (zero: none), unless it is set for it.
func (o *ownerTimer) point(at, now time.Time) {
	if at.Equal(o.at) {
		return
	}
	o.t.Stop()
	o.at = at
	if !at.IsZero() {
		o.t.Reset(at.Sub(now))
	}
}

// fired records that the timer went off.
func (o *ownerTimer) fired() { o.at = time.Time{} }
