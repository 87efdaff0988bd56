package pgoutbox

import "time"

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
	endedKeys  map[string]struct{}
	lost       []claimToken // claims whose reply was lost; their rows go back (ReleaseClaim)
	pf         prefetch
	scan       claimScan
}

func newClaimSchedule(cfg *SubscriberConfig, now time.Time) claimSchedule {
	return claimSchedule{
		want:      true,
		idlePoll:  cfg.MinPollInterval,
		gate:      newRetryGate(),
		endedKeys: map[string]struct{}{},
		pf:        newPrefetch(cfg.MaxInFlight, cfg.MaxDeliveries == 0, now),
		scan:      newClaimScan(),
	}
}
