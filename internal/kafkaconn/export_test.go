package kafkaconn

import "github.com/kfn-dev/kfn/runtime"

// CachedToken returns the token that the process's token source for s's
// OAUTHBEARER settings holds now, without reading or fetching one.
func CachedToken(sec runtime.KafkaSecurity) string {
	s := security(sec)
	secret, _ := s.clientSecret()
	src := tokenFor(s, secret)
	src.mu.Lock()
	defer src.mu.Unlock()
	return src.token
}
