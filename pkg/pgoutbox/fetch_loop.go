package pgoutbox

import (
	"context"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// subscription is one Subscribe call: a fetch loop that claims rows into
// its lease window (lease_window.go), MaxInFlight workers that hand them to
// the Router and wait for the verdict, and a completer that writes verdicts
// back (completer.go).
type subscription struct {
	s      *Subscriber
	cfg    *SubscriberConfig
	topic  string
	ctx    context.Context // the Subscribe ctx: parent of message contexts
	out    chan *message.Message
	logger watermill.LoggerAdapter
	waiter *notifier.Waiter

	window   *leaseWindow
	work     chan *delivery // claimed rows waiting for a worker
	selfWake chan struct{}  // the completer wrote nacks: look again when they are due

	stop          chan struct{}   // closed: claim and hand out nothing more
	stopCtx       context.Context // done when stop closes
	cancelStopCtx context.CancelFunc
	abort         chan struct{} // closed: stop waiting for verdicts (drain over)
	abortOnce     sync.Once
	loops         sync.WaitGroup

	rescan atomic.Bool // rows went back behind the cursor: scan from the start
	order  sync.Mutex  // orders a give-back against a claim's push into the buffer

	comp *completer
}

func newSubscription(s *Subscriber, ctx context.Context, topic string, waiter *notifier.Waiter) *subscription {
	sub := &subscription{
		s:        s,
		cfg:      &s.cfg,
		topic:    topic,
		ctx:      ctx,
		out:      make(chan *message.Message),
		logger:   s.logger.With(watermill.LogFields{"topic": topic}),
		waiter:   waiter,
		window:   newLeaseWindow(s.cfg.MaxInFlight, s.cfg.MaxDeliveries == 0),
		work:     make(chan *delivery, s.cfg.MaxInFlight+maxPrefetch),
		selfWake: make(chan struct{}, 1),
		stop:     make(chan struct{}),
		abort:    make(chan struct{}),
	}
	sub.stopCtx, sub.cancelStopCtx = context.WithCancel(context.Background())
	sub.comp = newCompleter(sub)
	return sub
}

// run owns the subscription's lifecycle; it returns after the output
// channel is closed.
func (sub *subscription) run() {
	defer sub.s.subs.Done()
	go sub.comp.run()
	sub.loops.Add(1 + sub.cfg.MaxInFlight)
	go sub.fetchLoop()
	for range sub.cfg.MaxInFlight {
		go sub.worker()
	}

	select {
	case <-sub.ctx.Done():
	case <-sub.s.closing:
	}
	close(sub.stop)
	sub.cancelStopCtx()
	if sub.cfg.DrainTimeout < 0 {
		sub.endDrain()
	} else {
		t := time.AfterFunc(sub.cfg.DrainTimeout, sub.endDrain)
		defer t.Stop()
	}
	sub.loops.Wait()
	sub.endDrain()
	// Rows claimed but never handed out go back with their delivery count
	// undone: they were not delivered.
	for {
		select {
		case d := <-sub.work:
			if d.giveBack() { // unless the completer gave it back already
				sub.comp.release(d, true)
			}
			continue
		default:
		}
		break
	}
	sub.comp.close() // writes every pending verdict and release
	sub.waiter.Stop()
	close(sub.out)
	sub.logger.Debug("Subscription closed", nil)
}

func (sub *subscription) endDrain() {
	sub.abortOnce.Do(func() {
		close(sub.abort)
		sub.comp.stopBackpressure()
	})
}

// fetchLoop claims rows into free slots. While claims come back non-empty it
// claims again at once; when one comes back empty it sleeps until a NOTIFY
// wakes it, until the next scheduled row is due, or for the idle poll
// interval, which grows from MinPollInterval to MaxPollInterval.
func (sub *subscription) fetchLoop() {
	defer sub.loops.Done()
	errBackoff := newBackoff()
	idle := sub.cfg.MinPollInterval
	scan := newClaimScan()

	for {
		if sub.rescan.Swap(false) {
			scan.restart(false) // given-back rows lie behind the cursor
		}
		got, ok, err := sub.claimOnce(scan)
		if !ok {
			return
		}
		if err != nil {
			wait := errBackoff.NextBackOff()
			sub.logger.Error("Claim failed; retrying", err, watermill.LogFields{"retry_in": wait.String()})
			if !sub.sleep(wait) {
				return
			}
			continue
		}
		errBackoff.Reset()
		if got > 0 {
			idle = sub.cfg.MinPollInterval
			continue
		}
		wait := jitter(idle)
		idle = min(idle*2, sub.cfg.MaxPollInterval)
		woke, byTimer := sub.idleWait(wait)
		if !woke {
			return
		}
		// Whatever woke us may be behind the cursor: a commit of a
		// transaction that began before rows already claimed, or a lease
		// that expired (the timer was set to it).
		scan.restart(byTimer)
	}
}

// claimOnce waits for room in the lease window, claims into it and hands the
// rows to the workers. It reports ok=false when the subscription stops.
func (sub *subscription) claimOnce(scan *claimScan) (got int, ok bool, err error) {
	asked := sub.window.acquire(sub.stop)
	if asked == 0 {
		return 0, false, nil
	}
	rows, err := sub.claim(asked, scan)
	sub.window.unreserve(asked - len(rows))
	sub.order.Lock()
	defer sub.order.Unlock()
	if sub.rescan.Load() {
		// The completer gave the buffer back while this claim ran: these
		// rows are newer than the ones given back, so they go back too and
		// the next claim takes everything from the start, in order.
		for _, d := range rows {
			d.giveBack()
			sub.comp.release(d, true)
		}
		sub.window.unreserve(len(rows))
		return 0, true, err
	}
	for _, d := range rows {
		sub.work <- d // never blocks: the window bounds the rows held
	}
	return len(rows), true, err
}

// newBackoff paces retries after database errors: 50ms doubling to 5s,
// with jitter, forever. Options, not fields: NewExponentialBackOff resets
// itself, so fields set afterwards would only apply after the next Reset.
func newBackoff() *backoff.ExponentialBackOff {
	return backoff.NewExponentialBackOff(backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0))
}

// sleep waits d; it reports false when the subscription is stopping.
func (sub *subscription) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-sub.stop:
		return false
	case <-t.C:
		return true
	}
}

// idleWait sleeps after an empty claim: at most the poll interval, less if
// a scheduled row (or an expiring lease) is due sooner, and it ends early
// when a NOTIFY says rows are due. A NOTIFY about rows published for later
// only makes it ask again when the next row is due. It reports false when
// the subscription is stopping, and whether the timer ended the wait.
func (sub *subscription) idleWait(poll time.Duration) (woke, byTimer bool) {
	wait := poll
	if due, ok := sub.nextDue(); ok && due < wait {
		wait = due
	}
	deadline := time.Now().Add(wait)
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-sub.stop:
			return false, false
		case <-t.C:
			return true, true
		case <-sub.waiter.C:
			return true, false
		case <-sub.selfWake:
			return true, false
		case <-sub.waiter.Scheduled:
			if due, ok := sub.nextDue(); ok && due < time.Until(deadline) {
				deadline = time.Now().Add(due)
				t.Reset(due)
			}
		}
	}
}

// jitter spreads d by ±20% so idle subscribers do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// claim leases up to n rows with the claim statement (query.Claim). It does
// not use the subscription's context: a claim cut off after the server ran
// it would leave rows leased that nobody knows of until the lease expires.
func (sub *subscription) claim(n int, scan *claimScan) ([]*delivery, error) {
	ctx, cancel := context.WithTimeout(context.Background(), sub.cfg.StatementTimeout)
	defer cancel()
	// Binary UUIDs: pgx encodes them directly, where strings would go
	// through a failed binary attempt and a formatted error first.
	token := pgtype.UUID{Bytes: uuid.New(), Valid: true}
	sent := time.Now()
	withExpired := scan.wantExpired(sent)
	rows, err := sub.s.pool.Query(ctx, sub.s.q.Claim, sub.topic, n, token,
		sub.cfg.Lease.Microseconds(), sub.cfg.WorkerID, scan.at, scan.id, withExpired)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*delivery
	var cursor pgtype.Int8
	var expired int64
	for rows.Next() {
		d := &delivery{token: token, outcome: &outcome{}}
		if err := rows.Scan(&d.id, &d.uuid, &d.payload, &d.metaRaw, &d.deliveries, &d.availableAt, &cursor, &expired); err != nil {
			return nil, err
		}
		d.claimedAt = sent
		d.leasedUntil(sent.Add(sub.cfg.Lease))
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		// The statement may have committed: the rows are leased under a
		// token nobody holds and come back when the lease expires.
		return nil, err
	}
	scan.claimed(sent, withExpired, int(expired), cursor, out)
	// RETURNING order is unspecified; deliver in queue order.
	sort.Slice(out, func(i, j int) bool {
		if !out[i].availableAt.Equal(out[j].availableAt) {
			return out[i].availableAt.Before(out[j].availableAt)
		}
		return out[i].id < out[j].id
	})
	if len(out) > 0 {
		sub.comp.track(out)
	}
	sub.s.obs.observe(Event{Kind: EventClaimed, Topic: sub.topic, Count: len(out)})
	return out, nil
}

// claimScan is where the fetch loop's claims start scanning; see query.Claim
// for why a busy loop scans from a cursor.
type claimScan struct {
	at           pgtype.Timestamptz // cursor: the last ready row claimed
	id           int64
	fromStartAt  time.Time // when a claim last scanned from the start
	expiredAt    time.Time // when a claim last looked for expired leases
	forceExpired bool
}

// rescanEvery bounds how long a busy loop goes without scanning from the
// start, and without looking for expired leases.
const rescanEvery = time.Second

var scanFromStart = pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}

func newClaimScan() *claimScan {
	return &claimScan{at: scanFromStart, forceExpired: true}
}

// restart makes the next claim scan from the start, and look for expired
// leases too when asked.
func (c *claimScan) restart(expired bool) {
	c.at, c.id = scanFromStart, 0
	c.forceExpired = c.forceExpired || expired
}

func (c *claimScan) wantExpired(now time.Time) bool {
	return c.forceExpired || now.Sub(c.expiredAt) >= rescanEvery
}

// claimed moves the cursor past the last ready row of a claim, and
// schedules the next scan from the start.
func (c *claimScan) claimed(now time.Time, withExpired bool, expired int, cursor pgtype.Int8, rows []*delivery) {
	if withExpired {
		// Rows a crashed consumer held come back in a burst: keep looking
		// while the last look found some.
		c.expiredAt, c.forceExpired = now, expired > 0
	}
	if c.at == scanFromStart {
		c.fromStartAt = now
	}
	if now.Sub(c.fromStartAt) >= rescanEvery {
		c.restart(false)
		return
	}
	if !cursor.Valid {
		return
	}
	for _, d := range rows {
		if d.id == cursor.Int64 {
			c.at, c.id = pgtype.Timestamptz{Time: d.availableAt, Valid: true}, d.id
			return
		}
	}
}

// nextDue asks when the next row of the topic becomes claimable (a
// scheduled row or an expiring lease), so timers fire on time instead of at
// the next poll.
func (sub *subscription) nextDue() (time.Duration, bool) {
	// It only reads: a stopping subscription does not wait for it.
	ctx, cancel := context.WithTimeout(sub.stopCtx, sub.cfg.StatementTimeout)
	defer cancel()
	var us *int64
	if err := sub.s.pool.QueryRow(ctx, sub.s.q.NextDue, sub.topic).Scan(&us); err != nil || us == nil {
		return 0, false
	}
	// At least a millisecond: rounding must not make the loop spin on a
	// row that is due within a microsecond.
	return max(time.Duration(*us)*time.Microsecond, time.Millisecond), true
}

// worker hands claimed rows to the Router one at a time and waits for each
// verdict, so MaxInFlight workers bound the messages in flight.
func (sub *subscription) worker() {
	defer sub.loops.Done()
	for {
		select {
		case <-sub.stop:
			return
		case d := <-sub.work:
			sub.deliver(d)
			sub.window.done(1)
		}
	}
}

func (sub *subscription) deliver(d *delivery) {
	if !d.handOut() {
		return // the completer gave it back while it waited in the buffer
	}
	// A row that waited in the prefetch buffer while renewals could not
	// reach the database may be someone else's by now: give it back
	// (under its token) instead of risking two holders.
	if d.leaseLikelyGone(sub.cfg.StatementTimeout) {
		sub.comp.release(d, true)
		return
	}
	if max := sub.cfg.MaxDeliveries; max > 0 && d.deliveries > max {
		sub.comp.deadLetter(d, ReasonMaxDeliveries, "")
		return
	}
	msg, err := d.message()
	if err != nil {
		sub.s.obs.observe(Event{Kind: EventPoisoned, Topic: sub.topic, RowID: d.id, Deliveries: d.deliveries, Err: err})
		sub.comp.deadLetter(d, ReasonPoisoned, err.Error())
		return
	}
	select {
	case <-sub.stop:
		sub.comp.release(d, true)
		return
	default:
	}
	ctx, cancel := context.WithCancel(context.WithValue(sub.ctx, outcomeKey{}, d.outcome))
	defer cancel() // Ack and Nack end the message's context
	msg.SetContext(ctx)
	select {
	case sub.out <- msg:
	case <-sub.stop:
		sub.comp.release(d, true)
		return
	}
	select {
	case <-msg.Acked():
		sub.comp.ack(d)
	case <-msg.Nacked():
		sub.nacked(d, msg)
	case <-sub.abort:
		// Drain time is over and the handler has not answered: give the
		// row back (never delete it); a late Ack is ignored.
		sub.comp.release(d, false)
	}
}
