// A test's code run as an unprivileged user, for the permission errors a test run as root (whom no
// permission stops) could not see.
#pragma once

#include <grp.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

namespace ferry::test {

// Runs `f` in a child process as the user nobody when the test runs as root (whom no permission
// stops), else as it is; returns what `f` returned.
inline std::string unprivileged(const std::function<std::string()>& f) {
  if (::geteuid() != 0) return f();
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const std::string out =
        ::setgroups(0, nullptr) == 0 && ::setgid(65534) == 0 && ::setuid(65534) == 0 ? f() : "setuid failed";
    const ssize_t ignored = ::write(fds[1], out.data(), out.size());
    static_cast<void>(ignored);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

}  // namespace ferry::test
