package redact

import (
	"strings"
	"testing"
)

func TestRedactHidesEverySecret(t *testing.T) {
	for _, c := range []struct{ in, want, secret string }{
		{"postgres://kfn:s3cretpw@db:5432/kfn?sslmode=disable", "postgres://kfn:xxxxx@db:5432/kfn?sslmode=disable", "s3cretpw"},
		{"postgres://kfn@db/kfn", "postgres://kfn@db/kfn", ""},
		{"postgres://db/kfn?user=kfn&password=s3cretpw", "postgres://db/kfn?password=xxxxx&user=kfn", "s3cretpw"},
		{"host=db user=kfn password=s3cretpw dbname=kfn", "host=db user=kfn password=xxxxx dbname=kfn", "s3cretpw"},
		{"host=db password = 'it\\'s s3cret pw' dbname=kfn", "host=db password = xxxxx dbname=kfn", "it's s3cret pw"},
		{"host=db sslpassword=s3cretpw", "host=db sslpassword=xxxxx", "s3cretpw"},
		{"nats://alice:s3cretpw@nats:4222", "nats://alice:xxxxx@nats:4222", "s3cretpw"},
		{"nats://mytoken123@nats:4222", "nats://xxxxx@nats:4222", "mytoken123"},
		{"nats://a:4222,nats://mytoken123@b:4222", "nats://a:4222,nats://xxxxx@b:4222", "mytoken123"},
		{"mytoken123@nats:4222", "xxxxx@nats:4222", "mytoken123"},
		{"nats:4222", "nats:4222", ""},
		{"postgres://kfn:s3cret%pw@db:bad/kfn", "postgres://kfn:xxxxx@db:bad/kfn", "s3cret%pw"},
		{"postgres://kfn:s3cretpw@db:bad/kfn?password=x%", "<unparseable URL>", "s3cretpw"},
	} {
		got := Redact(c.in)
		if c.want != "" && got != c.want {
			t.Errorf("Redact(%q) = %q, want %q", c.in, got, c.want)
		}
		if c.secret != "" && strings.Contains(got, c.secret) {
			t.Errorf("Redact(%q) = %q shows the secret", c.in, got)
		}
		if HasSecret(c.in) != (c.secret != "") {
			t.Errorf("HasSecret(%q) = %v", c.in, HasSecret(c.in))
		}
		if c.secret != "" {
			if msg := Scrub("dial "+c.in+" failed: "+c.secret+".", c.in); strings.Contains(msg, c.secret) {
				t.Errorf("Scrub left the secret of %q: %q", c.in, msg)
			}
		}
	}
}
