package pgoutbox

import (
	"sync"
	"sync/atomic"
	"time"
)

// notifyLimiter decides which Publish calls send a NOTIFY: at most one per
// (channel, topic) per cooldown in this process (see
// PublisherConfig.NotifyCooldown). The last notify time is kept per
// process, not per Publisher: a service builds one Publisher per
// transaction, so only a process-wide record can space them.
type notifyLimiter struct {
	cooldown time.Duration // -1: always notify
}

// lastNotify maps channel + "\x00" + topic to the time (nanoseconds of
// processStart's monotonic clock) a Publish last chose to notify.
var (
	lastNotify     sync.Map // string -> *atomic.Int64
	lastNotifyKeys atomic.Int64
)

// Topics may be made up at run time (one per tenant, say): past
// notifyKeysSweepAt keys, records older than notifyKeyStale are dropped.
// Dropping a record costs at most one extra NOTIFY.
const (
	notifyKeysSweepAt = 4096
	notifyKeyStale    = time.Minute
)

// notifyTicket is a Publish's permission to notify. When the statement
// fails, or inserts nothing (every message skipped by its dedup key), no
// NOTIFY was sent and cancel gives the cooldown back, so the next Publish
// notifies instead of staying quiet behind a wake-up that never happened.
type notifyTicket struct {
	last      *atomic.Int64 // nil: not rate limited
	prev, now int64
}

// cancel undoes the record of this ticket, unless a later one replaced it.
func (t notifyTicket) cancel() {
	if t.last != nil {
		t.last.CompareAndSwap(t.now, t.prev)
	}
}

// allow reports whether this Publish should notify, and if so records it.
func (l notifyLimiter) allow(channel, topic string) (notifyTicket, bool) {
	if l.cooldown < 0 {
		return notifyTicket{}, true
	}
	key := channel + "\x00" + topic
	v, ok := lastNotify.Load(key)
	if !ok {
		var loaded bool
		if v, loaded = lastNotify.LoadOrStore(key, new(atomic.Int64)); !loaded {
			if lastNotifyKeys.Add(1) > notifyKeysSweepAt {
				sweepNotifyRecords()
			}
		}
	}
	last := v.(*atomic.Int64)
	now := int64(at(time.Now()))
	prev := last.Load()
	if prev != 0 && now-prev < int64(l.cooldown) {
		return notifyTicket{}, false
	}
	if !last.CompareAndSwap(prev, now) {
		return notifyTicket{}, false
	}
	return notifyTicket{last: last, prev: prev, now: now}, true
}

var (
	sweepMu   sync.Mutex
	lastSweep instant
)

// sweepNotifyRecords drops the records not used for notifyKeyStale. With
// more live topics than notifyKeysSweepAt it runs at most once a second.
func sweepNotifyRecords() {
	if !sweepMu.TryLock() {
		return // another Publish is sweeping
	}
	defer sweepMu.Unlock()
	now := at(time.Now())
	if lastSweep != 0 && now-lastSweep < instant(time.Second) {
		return
	}
	lastSweep = now
	cutoff := int64(now) - int64(notifyKeyStale)
	lastNotify.Range(func(k, v any) bool {
		if v.(*atomic.Int64).Load() < cutoff {
			lastNotify.Delete(k)
			lastNotifyKeys.Add(-1)
		}
		return true
	})
}
