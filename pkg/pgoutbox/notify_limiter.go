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
var lastNotify sync.Map // string -> *atomic.Int64

// allow reports whether this Publish should notify, and if so records it.
func (l notifyLimiter) allow(channel, topic string) bool {
	if l.cooldown < 0 {
		return true
	}
	key := channel + "\x00" + topic
	v, ok := lastNotify.Load(key)
	if !ok {
		v, _ = lastNotify.LoadOrStore(key, new(atomic.Int64))
	}
	last := v.(*atomic.Int64)
	now := int64(at(time.Now()))
	prev := last.Load()
	if prev != 0 && now-prev < int64(l.cooldown) {
		return false
	}
	return last.CompareAndSwap(prev, now)
}
