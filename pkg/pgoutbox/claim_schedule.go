package pgoutbox

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// claimSchedule is the claim-scheduling part of a subscription: whether a
// claim is wanted, under way or has to wait, how many rows it takes
// (prefetch) and where it scans from (claimScan), the give-backs a claim
// must not overtake, the ordering keys to ask for, the claims whose reply
// was lost. Only the owner touches it.
type claimSchedule struct {
	claiming   bool          // a claim is under way
	want       bool          // claim when there is room: the last claim found rows, or something woke us
	wokeDuring bool          // something woke us while the claim ran: an empty claim may have missed it
	lookAgain  time.Duration // next look after a publisher's wake-up, 0: none (see onNotified)
	idleUntil  time.Time     // an idle sleep ends then
	idlePoll   time.Duration // the next idle sleep
	gate       retryGate     // after a failed claim
	gen        uint64        // bumped by every give-back; a claim started before it gives its rows back too
	givingBack int           // give-backs not written yet: a claim now would overtake them
	withheld   bool          // the last claim left arrivals to open held batches and found nothing else
	keys       claimKeys     // the ordering keys the next claims ask for
	lost       lostClaims    // claims whose reply was lost: their rows go back (ReleaseClaim)
	pf         prefetch
	scan       claimScan
	cfg        *SubscriberConfig
}

func newClaimSchedule(cfg *SubscriberConfig, now time.Time, clock serverClock) claimSchedule {
	c := claimSchedule{
		cfg:      cfg,
		want:     true,
		idlePoll: cfg.MinPollInterval,
		gate:     newRetryGate(),
		keys:     newClaimKeys(),
		lost:     lostClaims{cfg: cfg},
		pf:       newPrefetch(cfg.MaxInFlight, cfg.MaxDeliveries == 0, now),
		scan:     newClaimScan(),
	}
	c.scan.clock = clock
	return c
}

// notified takes in what the notifier reported: rows due, rows scheduled
// (an empty claim plans the sleep anew, NextDue), rows another subscriber
// of this group returned, a vanished liveness lock (look for orphaned
// rows), or a server that answers again (claim without waiting out a
// failure's backoff).
func (c *claimSchedule) notified(k notifier.Kinds) {
	if k.Connected {
		c.gate.serverBack(time.Now())
	}
	if k.Orphans {
		c.scan.holderGone()
	}
	if k.Vanished || (k.Released && c.cfg.MaxInFlight == 1) {
		// A process may have died: the rows of its held transactions are
		// due again, behind a busy loop's cursor. So are rows another
		// subscriber returned, or fanned out from the arrivals (due at
		// their arrival): an ordered subscription takes them now, not
		// after later rows until its once-a-second look from the start.
		c.scan.restart(false)
	}
	if k.Due {
		// Publishers notify once per cooldown (PublisherConfig.
		// NotifyCooldown): rows of the quiet publishes right after this
		// one are found by a look again shortly after.
		c.lookAgain = lookAgainFirst
	}
	c.wake(false)
}

// After a wake-up by a publisher, an idle subscription looks again
// lookAgainFirst later, then at doubling intervals up to lookAgainLast
// (or its idle poll interval, when that is shorter): a row published
// quietly right after the notifying one waits about a cooldown, and one
// whose transaction commits later is found within about the time it took
// to commit, not a poll interval. Each look is one claim that finds
// nothing, and it stops at the first idle poll.
const (
	lookAgainFirst = 2 * DefaultNotifyCooldown
	lookAgainLast  = 512 * time.Millisecond
)

// wake makes the next claim happen as soon as there is room. An idle loop
// scans from the start then: whatever woke it (a commit of a transaction
// that began before rows it claimed, a released lease) may lie behind the
// cursor; a busy loop scans from the start every second anyway.
func (c *claimSchedule) wake(expired bool) {
	if c.claiming {
		c.wokeDuring = true
	}
	if !c.want && !c.scan.resume {
		c.scan.restart(expired)
	}
	c.scan.resume = false
	c.want = true
	c.idleUntil = time.Time{}
}

// passedDelivered takes in a claim that passed over a row delivered
// before (claimsFreshOnly): the next claim, once it may start, scans from
// the start, without an idle wait, and asks again for the keys this one
// asked for and took nothing of: the row passed over may be one's next,
// which nothing else asks for (a row given back would have ended its
// key; this one is left as it was), and a scan from the start reaches it
// only by windows when a backlog held back by keys lies before it.
// (Expired and orphaned leases it passed over count as reclaimed: the
// look for them goes on as after a look that took some,
// claimScan.claimed.)
func (c *claimSchedule) passedDelivered(r claimResult) {
	c.scan.restart(false)
	c.want, c.idleUntil = true, time.Time{}
	c.keys.askAgain(r)
}

// waiting reports whether no claim may start for reasons of its own: one
// is under way, none is wanted, a give-back must be written first, or a
// failure's backoff runs.
func (c *claimSchedule) waiting() bool {
	return c.claiming || !c.want || c.givingBack > 0 || c.gate.shut()
}

// start fixes the next claim of n rows: from the cursor, asking for the
// next rows of the keys that ended, looking for orphaned rows (sparing
// the holders spare returns, once the notifier can tell) when asked.
func (c *claimSchedule) start(n int, now time.Time, holder pgtype.Int8, spare func() ([]int64, bool)) claimRequest {
	c.claiming = true
	req := c.scan.request(n, c.gen, now)
	req.holder = holder
	if req.endedKeys = c.keys.take(now); len(req.endedKeys) > 0 {
		req.window = max(2*n, minScanWindow) // "heads" is in the windowed claim only
	}
	if c.scan.findOrphans {
		// Not before the notifier watched the locks for
		// notifier.OrphanGrace: until then it cannot tell a dead holder
		// from a reconnecting one.
		if ids, ok := spare(); ok {
			req.orphansOf = ids
		}
	}
	return req
}

// failed takes in a failed claim and returns the backoff before the next.
func (c *claimSchedule) failed(r claimResult, now time.Time) time.Duration {
	c.claiming, c.wokeDuring = false, false
	// A late claim returns the server's time: this machine's clock
	// stepped, and the next claim goes by it.
	c.scan.clock.saw(r.clock)
	c.keys.notAsked(r.req.endedKeys) // that claim did not happen
	if (r.req.window == 0 || r.req.held) && now.Sub(r.req.sent) >= slowClaim {
		// A claim without a window that failed slowly (its StatementTimeout,
		// mostly) may have walked a backlog of rows held back by their keys,
		// as a slow short one does (claimScan.claimed): the same claim would
		// fail again, for as long as the backlog stays. Windows bound it.
		c.scan.windowUntil = now.Add(keyedFor)
	}
	if !r.req.held && !leasedNothing(r.err) {
		// The statement may have committed: its rows would stay leased
		// under a token nobody holds. Give them back (ReleaseClaim) instead
		// of letting them wait for the lease, and without counting a
		// delivery nobody saw. Like any give-back, claims wait for it and
		// then scan from the start, so the rows keep their place. (A held
		// claim's transaction rolled back, or its connection is closed,
		// which the server rolls back: nothing to give back.)
		at := r.started // the deadline's base (see releasedClaims)
		if at.IsZero() {
			at = r.req.sent
		}
		c.lostClaim(r.req.token, at)
		c.gen++
	}
	return c.gate.failed(now)
}

// succeeded takes in a claim that ran, and reports whether something
// woke the subscription while it ran.
func (c *claimSchedule) succeeded(r claimResult) (woke bool) {
	woke = c.wokeDuring
	c.claiming, c.wokeDuring = false, false
	c.gate.succeeded()
	c.scan.claimed(r)
	c.keys.claimed(r)
	return woke
}

// next decides, after a claim whose rows were taken, when to claim again:
// at once while claims find rows, else after an idle wait.
func (c *claimSchedule) next(r claimResult, woke bool, now time.Time) {
	// Arrivals found to fan out are fanned out by the next claim, at once;
	// one that fanned out nothing (another subscriber's fan-out held the
	// topic) waits to be woken by that one's copies.
	if len(r.rows) > 0 || r.arrivals.fannedOut > 0 || (r.arrivals.waiting && !r.req.arrivals.fanOut) {
		c.want, c.idlePoll = true, c.cfg.MinPollInterval
		if c.lookAgain > 0 {
			// Still busy after a publisher's wake-up: quiet publishes may
			// keep coming, keep looking again after the claims run dry.
			c.lookAgain = lookAgainFirst
		}
		return
	}
	// Keys ended while this claim ran (keyEnded): it could not ask for
	// their next rows, the next claim does, at once. An idle wait here
	// would hold each of those keys for it (MinPollInterval at least),
	// every key of a subscription that holds them all, at every turn.
	ended := c.keys.any()
	if r.keyBusy > 0 {
		// Keyed rows whose key another claim took meanwhile: look again
		// after the shortest idle wait, from the start, not at claim speed.
		c.scan.restart(false)
		c.idleWait(ended, now)
		return
	}
	if woke {
		// The wake-up may announce a row committed after this claim's
		// snapshot: claim again instead of sleeping.
		c.scan.restart(false)
		c.want = true
		return
	}
	if r.last.id.Valid && r.free > 0 {
		// Competitors' claims had locked the rows of the window: the
		// cursor moved past them, go on at once.
		c.want = true
		return
	}
	if r.last.id.Valid {
		// Every row of the window waits for its key (held here or by a
		// competitor): go on from the cursor after the shortest idle wait,
		// so a backlog of held keys is read one window per wait, not at
		// claim speed. An ended key's next row is asked for directly.
		c.scan.resume = true
		c.idleWait(ended, now)
		return
	}
	if ended {
		c.want = true
		return
	}
	c.want = false
	var wait time.Duration
	if c.lookAgain > 0 && c.lookAgain < c.idlePoll && c.lookAgain <= lookAgainLast {
		wait = c.lookAgain
		c.lookAgain *= 2
	} else {
		c.lookAgain = 0
		wait = jitter(c.idlePoll)
		c.idlePoll = min(c.idlePoll*2, c.cfg.MaxPollInterval)
	}
	if r.dueIn > 0 && r.dueIn < wait {
		wait = r.dueIn
	}
	c.idleUntil = now.Add(wait)
}

// idleWait waits the shortest idle wait before the next claim, unless
// keys ended meanwhile (next).
func (c *claimSchedule) idleWait(ended bool, now time.Time) {
	c.want = ended
	if !ended {
		c.idleUntil = now.Add(c.cfg.MinPollInterval)
	}
}

// gaveBack records rows given back: a claim under way gives its rows back
// too (gen), and the next claim scans from the start, so they keep their
// place.
func (c *claimSchedule) gaveBack() {
	c.gen++
	c.scan.restart(false)
	c.want = true
}

// lostClaim records a claim whose reply was lost, to be given back
// (releasedClaims); claims wait for that.
func (c *claimSchedule) lostClaim(token pgtype.UUID, at time.Time) {
	c.lost.add(token, at)
	c.givingBack++
}

// releasedClaims takes in the release of the lost claims of tokens
// (lostClaims.released). Once one is written, claims go on, from the
// start. It returns how many releases of the oldest of them left have
// failed.
func (c *claimSchedule) releasedClaims(tokens []pgtype.UUID, err error, now time.Time) (tries int) {
	tries, freed, settled := c.lost.released(tokens, err, now)
	c.givingBack -= settled
	if freed {
		c.scan.restart(true)
		c.want = true
	}
	return tries
}

// keyEnded: a row with an ordering key was written (acked, nacked,
// dead-lettered) or left our hands, so the next row of its key may be
// claimable now. It may lie behind the cursor (the scan passed it while
// its predecessor was present): the next claim asks for the key's next
// row by its key.
func (c *claimSchedule) keyEnded(key string) {
	c.keys.end(key)
	c.want = true
	c.idleUntil = time.Time{}
}
